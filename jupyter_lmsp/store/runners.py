"""Runners: the processes that drive tasks, and their leases (LMSP B12).

A runner (today a Jupyter server's task runner) registers a row with who it is — host, boot,
process id and the process's start time — and a lease it renews with a heartbeat. Every task
it takes is marked with its id (`tasks.runner_id`) in the transaction that takes it.

Whether a runner is gone:

- on this machine (same host name, same boot, same process-id namespace) it is gone exactly
  when no process with its id and start time runs any more: a dead server is recognised at
  once, with no lease to wait for, and a live one is never mistaken for dead however late its
  heartbeat (a process id reused after the runner died has another start time);
- elsewhere, its lease must have expired.

`rules.recover_at_startup` applies the 11.3 table to the tasks of gone runners (and to tasks
no runner holds), one runner per transaction.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import psutil
from sqlalchemy import bindparam, delete, insert, select, update

from ..protocol.ids import new_id
from .database import Database
from .records import records, table
from .tables import Runner

# A process's start time is computed from the boot time, which the kernel may report a
# fraction of a second differently as the clock is adjusted: equal within this is the same.
START_TIME_TOLERANCE = 1.0

_runners = table(Runner)
_INSERT = insert(_runners)
_RENEW = (
    update(_runners)
    .where(_runners.c.id == bindparam("runner_id"))
    .values(heartbeat_at=bindparam("now"), lease_expires_at=bindparam("until"))
)
_DELETE = delete(_runners).where(_runners.c.id == bindparam("runner_id"))
_ALL = select(_runners).order_by(_runners.c.started_at)


@dataclass(frozen=True)
class ProcessIdentity:
    host: str
    boot_id: str  # the machine's boot, and the process-id namespace
    pid: int
    started_at: float


# Names this process's machine in the runners table instead of its host name: for machines
# that share one (and for tests that play a server on another machine).
HOST_VARIABLE = "LMSP_RUNNER_HOST"


@cache
def _machine() -> tuple[str, str]:
    host = os.environ.get(HOST_VARIABLE) or socket.gethostname()
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = f"boot-{int(psutil.boot_time())}"
    with contextlib.suppress(OSError):
        # Processes in another pid namespace (another container on the same kernel) are
        # invisible here: their runners must not look dead because of it.
        boot += f"/pidns:{os.stat('/proc/self/ns/pid').st_ino}"
    return host, boot


def this_process() -> ProcessIdentity:
    host, boot = _machine()
    return ProcessIdentity(host, boot, os.getpid(), psutil.Process().create_time())


def process_alive(pid: int, started_at: float) -> bool:
    """Whether the process `pid` that started at `started_at` still runs (on this machine)."""
    try:
        proc = psutil.Process(pid)
        if abs(proc.create_time() - started_at) > START_TIME_TOLERANCE:
            return False  # the id was reused by another process
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True  # it exists; we may not look at it


def gone_reason(runner: Runner, now: float, here: ProcessIdentity | None = None) -> str | None:
    """Why `runner` is gone ("process_gone", "lease_expired"), or None while it is alive."""
    here = here or this_process()
    if (runner.host, runner.boot_id) == (here.host, here.boot_id):
        if runner.pid == here.pid and abs(runner.process_started_at - here.started_at) < 1e-6:
            return None  # this very process
        alive = process_alive(runner.pid, runner.process_started_at)
        return None if alive else "process_gone"
    return "lease_expired" if runner.lease_expires_at < now else None


def register(
    db: Database, *, kind: str = "server", label: str = "", lease_seconds: float
) -> Runner:
    """Register this process as a runner holding a lease of `lease_seconds`."""
    me = this_process()
    now = time.time()
    runner = Runner(
        id=new_id("runner"),
        kind=kind,
        host=me.host,
        boot_id=me.boot_id,
        pid=me.pid,
        process_started_at=me.started_at,
        label=label,
        started_at=now,
        heartbeat_at=now,
        lease_expires_at=now + lease_seconds,
    )
    with db.writing() as conn:
        conn.execute(_INSERT, runner.model_dump())
    return runner


def renew(db: Database, runner_id: str, lease_seconds: float) -> bool:
    """The heartbeat: extend the lease. False if the runner is no longer registered (another
    process found its lease expired and recovered its tasks)."""
    now = time.time()
    with db.writing() as conn:
        changed = conn.execute(
            _RENEW, {"runner_id": runner_id, "now": now, "until": now + lease_seconds}
        ).rowcount
    return changed == 1


def unregister(db: Database, runner_id: str) -> None:
    """A runner stopping cleanly: its row goes, and with it its hold on unfinished tasks
    (they are then nobody's, and the next recovery, by any server, takes them)."""
    with db.writing() as conn:
        conn.execute(_DELETE, {"runner_id": runner_id})


def list_runners(db: Database) -> list[Runner]:
    with db.reading() as conn:
        return records(Runner, conn.execute(_ALL))


def gone_runners(db: Database, now: float | None = None) -> list[tuple[Runner, str]]:
    """The registered runners that are gone, with why."""
    now = time.time() if now is None else now
    here = this_process()
    found = []
    for runner in list_runners(db):
        reason = gone_reason(runner, now, here)
        if reason is not None:
            found.append((runner, reason))
    return found
