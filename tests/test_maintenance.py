"""`jupyter lmsp backup`, `restore` and `doctor`, run as the command line runs them.

What these tests prove:

- a backup taken while another thread keeps committing is consistent (SQLite's checks pass,
  every task's log is whole) and holds everything committed before it began; it is a single
  file; the command shows progress; an existing target is refused;
- a restore puts the backup's contents in place (the database equals the backup, still in WAL
  mode) after keeping a copy of what it replaces; it refuses while a server holds a lease on
  the database, a backup of a newer schema, and a file that is not an LMSP database;
- `doctor` reports the schema revision, SQLite's verdict, each runner with its lease and
  whether it is alive, and the unfinished tasks with who holds them; it reports an old
  database without upgrading it, and a damaged one (exit status 1).
"""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from storehelpers import check_log, dump, make_task, open_db

from jupyter_lmsp import doctor
from jupyter_lmsp.store import runners, schema


def lmsp(data_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "jupyter_lmsp.cli", "--data-dir", str(data_dir), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def data(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    return folder


def _task_ids(path: Path) -> set[str]:
    conn = sqlite3.connect(path)
    try:
        return {r[0] for r in conn.execute("SELECT id FROM tasks")}
    finally:
        conn.close()


def test_a_backup_taken_while_writes_go_on_is_consistent_and_complete(data, tmp_path):
    db = open_db(data)
    before = {make_task(db, state) for state in ("queued", "running", "completed", "cancelled")}
    stop = threading.Event()
    written: list[str] = []

    def keep_writing() -> None:
        while not stop.is_set():
            written.append(make_task(db, "completed"))

    writer = threading.Thread(target=keep_writing)
    writer.start()
    try:
        out = lmsp(data, "backup", str(tmp_path / "copy.sqlite"))
    finally:
        stop.set()
        writer.join()
    assert out.returncode == 0, out.stderr
    assert "backup written to" in out.stdout
    assert "page" in out.stderr  # the progress bar
    assert written  # the copy was taken while tasks were being written

    copy = tmp_path / "copy.sqlite"
    assert not Path(f"{copy}-wal").exists()  # one file
    conn = sqlite3.connect(copy, isolation_level=None)
    assert conn.execute("PRAGMA journal_mode").fetchone() == ("delete",)
    assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    assert conn.execute("PRAGMA foreign_key_check").fetchall() == []
    copied = {r[0] for r in conn.execute("SELECT id FROM tasks")}
    conn.row_factory = sqlite3.Row
    for task_id in copied:
        check_log(conn, task_id)
    conn.close()
    assert before <= copied  # everything committed before the backup began
    assert copied <= before | set(written)
    db.dispose()

    again = lmsp(data, "backup", str(copy))
    assert again.returncode == 1 and "exists already" in again.stderr


def test_restore_puts_the_backup_in_place_and_keeps_what_it_replaced(data, tmp_path):
    db = open_db(data)
    kept = {make_task(db, "completed"), make_task(db, "running", "resume")}
    assert lmsp(data, "backup", str(tmp_path / "copy.sqlite")).returncode == 0
    later = make_task(db, "failed")  # after the backup
    backed_up = dump(sqlite3.connect(tmp_path / "copy.sqlite"))

    me = runners.register(db, lease_seconds=30)  # a server using the database
    refused = lmsp(data, "restore", str(tmp_path / "copy.sqlite"))
    assert refused.returncode == 1
    assert "A server is using" in refused.stderr and f"pid {me.pid}" in refused.stderr
    assert later in _task_ids(data / "lmsp.sqlite")  # untouched
    runners.unregister(db, me.id)
    db.dispose()

    out = lmsp(data, "restore", str(tmp_path / "copy.sqlite"))
    assert out.returncode == 0, out.stderr
    assert f"revision {schema.HEAD}" in out.stdout
    restored = sqlite3.connect(data / "lmsp.sqlite")
    assert restored.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    assert dump(restored) == backed_up
    restored.close()
    assert _task_ids(data / "lmsp.sqlite") == kept
    (previous,) = data.glob("lmsp.sqlite.before-restore-*")
    assert later in _task_ids(previous)  # what it replaced is kept


def test_restore_refuses_a_newer_schema_and_a_foreign_file(data, tmp_path):
    open_db(data).dispose()
    newer = tmp_path / "newer.sqlite"
    open_db(tmp_path, "newer.sqlite").dispose()
    conn = sqlite3.connect(newer)
    conn.execute("UPDATE alembic_version SET version_num = '9999'")
    conn.commit()
    conn.close()
    out = lmsp(data, "restore", str(newer))
    assert out.returncode == 1 and "newer than this" in out.stderr

    foreign = tmp_path / "foreign.sqlite"
    conn = sqlite3.connect(foreign)
    conn.execute("CREATE TABLE notes (x)")
    conn.commit()
    conn.close()
    out = lmsp(data, "restore", str(foreign))
    assert out.returncode == 1 and "not an LMSP database" in out.stderr
    text = tmp_path / "text.sqlite"
    text.write_text("not a database at all" * 100)
    out = lmsp(data, "restore", str(text))
    assert out.returncode == 1 and "not a sound SQLite database" in out.stderr


def test_doctor_reports_schema_checks_runners_and_unfinished_tasks(data):
    db = open_db(data)
    me = runners.register(db, lease_seconds=30)
    held = make_task(db, "running", "resume")
    unheld = make_task(db, "queued", "fail")
    make_task(db, "completed")
    conn = sqlite3.connect(data / "lmsp.sqlite")
    conn.execute("UPDATE tasks SET runner_id = ? WHERE id = ?", (me.id, held))
    conn.commit()
    conn.close()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = runners.register(db, lease_seconds=30)
    conn = sqlite3.connect(data / "lmsp.sqlite")
    conn.execute("UPDATE runners SET pid = ? WHERE id = ?", (gone.pid, dead.id))
    conn.commit()
    conn.close()

    diagnosis = doctor.examine(data / "lmsp.sqlite")
    assert diagnosis.healthy and diagnosis.schema.revision == schema.HEAD
    states = {s.runner.id: s for s in diagnosis.runners}
    assert states[me.id].gone is None and dict(states[me.id].tasks) == {"running": 1}
    assert states[dead.id].gone == "process_gone"
    assert dict(diagnosis.unheld) == {"queued": 1}
    assert {t.id for t in diagnosis.unfinished} == {held, unheld}

    out = lmsp(data, "doctor")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert f"revision {schema.HEAD} (current)" in text and "check:    ok" in text
    assert me.id in text and "alive, lease expires in" in text
    assert dead.id in text and "GONE (its process is gone)" in text
    assert f"{held}  running" in text and f"held by {me.id}" in text
    assert f"{unheld}  queued" in text and "held by no runner" in text
    db.dispose()


def test_doctor_leaves_an_old_database_alone_and_finds_damage(data):
    conn = sqlite3.connect(data / "lmsp.sqlite")
    conn.executescript(
        "CREATE TABLE service_config (key VARCHAR PRIMARY KEY, value TEXT);"
        + "".join(
            f"CREATE TABLE {t} (id VARCHAR PRIMARY KEY);"
            for t in ("clients", "pairings", "models", "responses", "tasks", "idempotency_keys")
        )
        + "CREATE TABLE task_events (id INTEGER PRIMARY KEY, task_id VARCHAR);"
    )
    conn.close()
    out = lmsp(data, "doctor")
    assert out.returncode == 0, out.stderr
    assert f"revision {schema.RELEASE_0_1_0}, older than {schema.HEAD}" in out.stdout
    conn = sqlite3.connect(data / "lmsp.sqlite")
    names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    conn.close()
    assert "alembic_version" not in names and not list(data.glob("*.backup-*"))

    broken = data / "broken"
    broken.mkdir()
    db = open_db(broken)
    for _ in range(30):
        make_task(db, "completed")
    db.dispose()
    conn = sqlite3.connect(broken / "lmsp.sqlite", isolation_level=None)
    conn.execute("PRAGMA foreign_keys=OFF")
    conn.execute(
        "INSERT INTO task_events (task_id, sequence_number, type, data, created_at)"
        " VALUES ('task_missing', 0, 'x', '{}', 0)"
    )
    conn.close()
    out = lmsp(broken, "doctor")
    assert out.returncode == 1
    assert "task_events row" in out.stdout and "refers to a missing row of tasks" in out.stdout


def test_doctor_reports_the_workers_blas_choice_on_request(data):
    open_db(data).dispose()
    out = lmsp(data, "doctor", "--blas")
    assert out.returncode == 0, out.stderr
    assert "inference worker BLAS:" in out.stdout
    assert "chosen: " in out.stdout and "reference" in out.stdout
