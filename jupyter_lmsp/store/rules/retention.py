"""LMSP 11.2, retention: finished tasks and their events are kept for the retention period, and
unfinished tasks are never deleted (every DELETE of a task names the terminal states itself,
whatever the rows chosen before it said)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import BindParameter, bindparam, delete, select

from ...protocol.states import TERMINAL_STATES, TaskState
from ..database import Database
from ..records import table
from ..tables import IdempotencyKey
from .rows import EVENTS, RESPONSES, TASK_FOR_UPDATE, TASKS, chunks

_TERMINAL = [str(s) for s in TERMINAL_STATES]
_KEYS = table(IdempotencyKey)

_EXPIRED = select(TASKS.c.id).where(
    TASKS.c.state.in_(_TERMINAL),
    TASKS.c.finished_at.is_not(None),
    TASKS.c.finished_at < bindparam("cutoff"),
)
_IDS: BindParameter[Any] = bindparam("ids", expanding=True)
_DELETE_EVENTS = delete(EVENTS).where(EVENTS.c.task_id.in_(_IDS))
_DELETE_RESPONSES = delete(RESPONSES).where(RESPONSES.c.task_id.in_(_IDS))
_DELETE_TASKS = delete(TASKS).where(TASKS.c.id.in_(_IDS), TASKS.c.state.in_(_TERMINAL))
_DELETE_KEYS = delete(_KEYS).where(_KEYS.c.expires_at < bindparam("now"))


@dataclass
class PurgeReport:
    tasks: int = 0
    events: int = 0
    responses: int = 0
    idempotency_keys: int = 0


def purge_expired(db: Database, retention_seconds: float, now: float | None = None) -> PurgeReport:
    """Delete tasks finished more than `retention_seconds` ago, their events and responses, and
    expired idempotency keys. Only terminal tasks qualify, whatever their age."""
    now = time.time() if now is None else now
    report = PurgeReport()
    with db.writing() as conn:
        ids = list(conn.execute(_EXPIRED, {"cutoff": now - retention_seconds}).scalars())
        for chunk in chunks(ids, 500):
            report.events += conn.execute(_DELETE_EVENTS, {"ids": chunk}).rowcount
            report.responses += conn.execute(_DELETE_RESPONSES, {"ids": chunk}).rowcount
            report.tasks += conn.execute(_DELETE_TASKS, {"ids": chunk}).rowcount
        report.idempotency_keys = conn.execute(_DELETE_KEYS, {"now": now}).rowcount
    return report


def delete_finished_task(db: Database, task_id: str) -> bool:
    """Delete one finished task with its events and response (a client's explicit delete).
    An unfinished task is left alone and False returned: only finished tasks are deleted."""
    with db.writing() as conn:
        row = conn.execute(TASK_FOR_UPDATE, {"id": task_id}).first()
        if row is None or TaskState(row.state) not in TERMINAL_STATES:
            return False
        conn.execute(_DELETE_EVENTS, {"ids": [task_id]})
        conn.execute(_DELETE_RESPONSES, {"ids": [task_id]})
        conn.execute(_DELETE_TASKS, {"ids": [task_id]})
    return True
