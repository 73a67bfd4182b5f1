"""A full disk never wedges a task (issue 43), on a real tmpfs data folder.

The server's data folder (its SQLite database) is a 24 MiB tmpfs. While a response is being
generated the disk is filled: its output commit fails, so the task fails (`storage_full`) and
its job stops in the worker; a new request is a 507 with `Retry-After`, never a 500. Once the
space is freed the task's end lands, a new request runs to completion without a restart, the
database passes `PRAGMA integrity_check` and the task's events are numbered without a gap.
"""

from __future__ import annotations

import contextlib
import errno
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from securityhelpers import database
from serverproc import MODEL, ServerProcess, with_test_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "data"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mount)], capture_output=True
    )
    if done.returncode != 0:
        pytest.fail(f"cannot mount a tmpfs here (root is needed): {done.stderr.decode()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _fill(folder: Path) -> Path:
    """A file that takes every free byte of `folder`'s file system."""
    filler = folder / "filler"
    block = b"\0" * (1 << 20)
    with open(filler, "wb", buffering=0) as f:
        with contextlib.suppress(OSError):
            while True:
                f.write(block)
        # The last bytes, in smaller writes.
        for size in (1 << 16, 1 << 12, 1 << 8, 1):
            with contextlib.suppress(OSError):
                while True:
                    f.write(block[:size])
    try:
        (folder / "probe").write_bytes(b"x" * 4096)
    except OSError as e:
        assert e.errno == errno.ENOSPC
    else:
        raise AssertionError("the disk is not full")
    return filler


def _task(client: Any, task_id: str) -> dict[str, Any]:
    r = client.get(f"/tasks/{task_id}")
    assert r.status_code == 200, r.text
    return dict(r.json())


def _until(predicate: Any, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        found = predicate()
        if found:
            return found
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_a_full_disk_fails_the_task_answers_507_and_recovers(small_disk, test_model_dir):
    data = with_test_model(small_disk, test_model_dir)
    with ServerProcess(data, engine_token_delay=0.02) as server, server.client() as owner:
        long = {"model": MODEL, "input": "Tell me a long story.", "background": True}
        long |= {"max_output_tokens": 4000, "temperature": 0}
        r = owner.post("/responses", json=long)
        assert r.status_code == 202, r.text
        task_id = r.json()["task_id"]
        _until(lambda: _task(owner, task_id)["state"] == "running")
        time.sleep(0.5)  # some output committed before the disk fills
        filler = _fill(small_disk)
        try:
            # A new request: 507 with Retry-After (not a 500), while the disk stays full.
            refused = owner.post("/responses", json={**long, "max_output_tokens": 4})
            assert refused.status_code == 507, refused.text
            assert refused.json()["error"]["code"] == "storage_full"
            assert int(refused.headers["Retry-After"]) > 0
            # The task's output cannot be stored: its job stops (no more tokens generated).
            time.sleep(1.0)
        finally:
            filler.unlink()
        ended = _until(
            lambda: (t := _task(owner, task_id))["state"] in ("failed", "completed") and t
        )
        assert ended["state"] == "failed", ended
        response = owner.get(f"/responses/{ended['response_id']}").json()
        assert response["error"]["code"] == "storage_full", response["error"]
        # Full service again, without a restart.
        again = owner.post("/responses", json={**long, "max_output_tokens": 8})
        assert again.status_code == 202, again.text
        done = _until(
            lambda: (
                (t := _task(owner, again.json()["task_id"]))["state"]
                in ("failed", "completed", "cancelled")
                and t
            )
        )
        assert done["state"] == "completed", done
    with contextlib.closing(database(data)) as db:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        numbers = [
            row[0]
            for row in db.execute(
                "SELECT sequence_number FROM task_events WHERE task_id = ? "
                "ORDER BY sequence_number",
                (task_id,),
            )
        ]
        assert numbers == list(range(numbers[0], numbers[0] + len(numbers))), numbers
