"""Online, consistent copies of the SQLite database, through SQLite's backup API.

`backup` copies the live database while servers keep using it: the copy is read inside one
read transaction, so it is the database as of one commit (WAL lets writers go on meanwhile),
never a mix of two. It is written to a temporary file beside the target, checked, and renamed
into place, so a copy that exists is complete. `restore` copies a backup into the live
database as one write transaction: every reader sees either the old database or the restored
one. Both report progress in pages, for the command line's progress bar.

A restore replaces what running servers hold in memory as much as what is on disk, so it
refuses while a runner (a server) holds a lease on the database, unless forced.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

Progress = Callable[[int, int], None]  # (pages copied, pages in all)

# Pages copied per step of the backup API: small enough for a smooth progress bar, large
# enough that a step's overhead does not matter (4 MiB with 4 KiB pages).
PAGES_PER_STEP = 1024


class BackupError(RuntimeError):
    """A backup or restore that cannot be done (the message says why)."""


@dataclass
class CopyReport:
    path: Path
    pages: int
    bytes: int
    seconds: float


def backup(
    source: str | os.PathLike[str],
    target: str | os.PathLike[str],
    progress: Progress | None = None,
    *,
    overwrite: bool = False,
) -> CopyReport:
    """Copy the database file `source` (live or not) to a new file `target`.

    The copy is a single file (rollback journal mode, not WAL), readable by any SQLite, with
    mode 0600 like the database itself holds secrets' hashes.
    """
    source, target = Path(source), Path(target)
    if not source.is_file():
        raise BackupError(f"No database at {source}.")
    if target.exists() and not overwrite:
        raise BackupError(f"{target} exists already; choose another path.")
    if target.resolve() == source.resolve():
        raise BackupError("The backup must go to another file than the database.")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.partial")
    _remove(partial)
    started = time.monotonic()
    _create_private(partial)
    src = sqlite3.connect(source, isolation_level=None, timeout=30)
    dst = sqlite3.connect(partial, isolation_level=None)
    try:
        # One read transaction around every step: each step reads the same snapshot, so the
        # copy is consistent and never restarts because another process committed meanwhile.
        src.execute("BEGIN")
        src.execute("SELECT count(*) FROM sqlite_master").fetchone()
        src.backup(dst, pages=PAGES_PER_STEP, progress=_pages(progress))
        src.execute("COMMIT")
        dst.execute("PRAGMA journal_mode=DELETE")
        pages = dst.execute("PRAGMA page_count").fetchone()[0]
        check = dst.execute("PRAGMA quick_check").fetchone()[0]
        if check != "ok":
            raise BackupError(f"The copy failed SQLite's check: {check}")
    except BaseException:
        dst.close()
        _remove(partial)
        raise
    finally:
        src.close()
    dst.close()
    os.replace(partial, target)
    return CopyReport(target, pages, target.stat().st_size, time.monotonic() - started)


def restore(
    backup_file: str | os.PathLike[str],
    database: str | os.PathLike[str],
    progress: Progress | None = None,
) -> CopyReport:
    """Replace the contents of `database` with those of `backup_file`, in one transaction.

    The caller checks first that the backup is a sound LMSP database and that no server is
    running on `database` (see `jupyter_lmsp.store.doctor`). The database stays in WAL mode.
    """
    backup_file, database = Path(backup_file), Path(database)
    if not backup_file.is_file():
        raise BackupError(f"No backup at {backup_file}.")
    started = time.monotonic()
    database.parent.mkdir(parents=True, exist_ok=True)
    if not database.exists():
        _create_private(database)
    src = sqlite3.connect(backup_file, isolation_level=None, timeout=30)
    dst = sqlite3.connect(database, isolation_level=None, timeout=30)
    try:
        src.execute("BEGIN")
        src.backup(dst, pages=PAGES_PER_STEP, progress=_pages(progress))
        src.execute("COMMIT")
        dst.execute("PRAGMA journal_mode=WAL")
        pages = dst.execute("PRAGMA page_count").fetchone()[0]
    finally:
        src.close()
        dst.close()
    return CopyReport(database, pages, database.stat().st_size, time.monotonic() - started)


def integrity(path: str | os.PathLike[str], quick: bool = False) -> list[str]:
    """SQLite's integrity check and foreign-key check of a database file: the problems found
    ([] when sound)."""
    conn = sqlite3.connect(Path(path), isolation_level=None, timeout=30)
    try:
        pragma = "quick_check" if quick else "integrity_check"
        problems = [row[0] for row in conn.execute(f"PRAGMA {pragma}") if row[0] != "ok"]
        for table, rowid, parent, _ in conn.execute("PRAGMA foreign_key_check"):
            problems.append(f"{table} row {rowid} refers to a missing row of {parent}")
        return problems
    except sqlite3.DatabaseError as e:
        return [str(e)]
    finally:
        conn.close()


def _pages(progress: Progress | None) -> Callable[[int, int, int], None] | None:
    if progress is None:
        return None
    return lambda _status, remaining, total: progress(total - remaining, total)


def _create_private(path: Path) -> None:
    """An empty file only its owner may read: a database holds hashes of secrets."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.close(fd)


def _remove(path: Path) -> None:
    for suffix in ("", "-journal", "-wal", "-shm"):
        with contextlib.suppress(FileNotFoundError):
            os.remove(f"{path}{suffix}")


def check_restorable(backup_file: Path, database: Path, *, force: bool = False) -> str:
    """Why `backup_file` may replace `database` (its schema, described), or a `BackupError`:
    the backup is not a sound LMSP database, it is of a newer schema than this version knows,
    or a server (a runner with a live lease) is using `database` (unless `force`)."""
    from sqlalchemy import create_engine

    from . import runners, schema
    from .database import Database, sqlite_url

    if not backup_file.is_file():
        raise BackupError(f"No backup at {backup_file}.")
    problems = integrity(backup_file, quick=True)
    if problems:
        raise BackupError(f"{backup_file} is not a sound SQLite database: {problems[0]}")
    engine = create_engine(sqlite_url(backup_file))
    try:
        with engine.connect() as conn:
            status = schema.status(conn)
    finally:
        engine.dispose()
    if status.state in ("foreign", "empty"):
        raise BackupError(f"{backup_file} is not an LMSP database.")
    if status.state == "newer":
        raise BackupError(
            f"{backup_file} has schema revision {status.revision}, newer than this "
            f"jupyter-lmsp knows ({schema.HEAD}): restore it with a newer version."
        )
    if database.exists() and not force:
        db = Database(sqlite_url(database), upgrade=False)
        try:
            if db.schema.status.state == "current":
                now = time.time()
                here = runners.this_process()
                live = [
                    r for r in runners.list_runners(db) if runners.gone_reason(r, now, here) is None
                ]
                if live:
                    who = ", ".join(f"pid {r.pid} on {r.host}" for r in live)
                    raise BackupError(
                        f"A server is using {database} ({who}): stop it first (its tasks are "
                        "held in its memory too), or pass --force."
                    )
        finally:
            db.dispose()
    return status.describe
