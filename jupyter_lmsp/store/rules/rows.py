"""Reading the rows a rule changes, and writing back its responses: Core statements, built once.

Tasks are read `FOR UPDATE` (on PostgreSQL; SQLAlchemy leaves the clause out on SQLite, whose
write transaction holds the database's one write lock already) before a rule changes them.
A response changes only in a transaction that holds its task, so it is read without a lock.

The rows a rule reads are `record`s: plain objects with the table model's attributes (and the
same values: the columns' types convert them either way). Building a SQLModel table object
costs ~60-70 µs (instrumented, validated) and setting an attribute on one ~2 µs; a task's
lifecycle reads a task and its response three times (its claim, its start, its end), and its
output once per commit, so the models were most of a small rule's own work (issue 42). The
table models remain for the rows a rule creates (`create_task`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

from sqlalchemy import bindparam, select, update
from sqlalchemy.engine import Connection, Row

from ...protocol import events as ev
from ...protocol.output import LogprobLookup, logprobs_from_events
from ..records import table
from ..tables import Response, Task, TaskEvent
from .types import not_found

TASKS = table(Task)
RESPONSES = table(Response)
EVENTS = table(TaskEvent)

_TASK = select(TASKS).where(TASKS.c.id == bindparam("id"))
TASK_FOR_UPDATE = _TASK.with_for_update()
_RESPONSE = select(RESPONSES).where(RESPONSES.c.id == bindparam("id"))
_RESPONSES = select(RESPONSES).where(RESPONSES.c.id.in_(bindparam("ids", expanding=True)))
_DELTAS = (
    select(EVENTS.c.data)
    .where(EVENTS.c.task_id == bindparam("task_id"), EVENTS.c.type == ev.TEXT_DELTA)
    .order_by(EVENTS.c.sequence_number)
)
# What a rule may change in a response (its end: `endings.terminate`; a cancel's reason).
_RESPONSE_COLUMNS = ("output", "usage", "error", "incomplete_reason", "completed_at")
_SAVE_RESPONSE = (
    update(RESPONSES)
    .where(RESPONSES.c.id == bindparam("key_id"))
    .values({name: bindparam(name) for name in _RESPONSE_COLUMNS})
)


def record(row: Row[Any]) -> Any:
    """A row as an object with the table model's attributes (see the module docstring)."""
    return SimpleNamespace(**row._mapping)


def load(conn: Connection, task_id: str) -> tuple[Task, Response | None]:
    """The task (locked until the transaction ends, on PostgreSQL) and its response, as
    records; a 404 when there is no such task."""
    found = load_if_any(conn, task_id)
    if found is None:
        raise not_found(task_id)
    return found


def load_if_any(conn: Connection, task_id: str) -> tuple[Task, Response | None] | None:
    row = conn.execute(TASK_FOR_UPDATE, {"id": task_id}).first()
    if row is None:
        return None
    task: Task = record(row)
    return task, response_of(conn, task.response_id)


def response_of(conn: Connection, response_id: str | None) -> Response | None:
    if response_id is None:
        return None
    row = conn.execute(_RESPONSE, {"id": response_id}).first()
    return None if row is None else record(row)


def responses_of(conn: Connection, response_ids: list[str]) -> dict[str, Any]:
    """The responses with these ids, as records, by id."""
    found: dict[str, Any] = {}
    for chunk in chunks(response_ids, 500):
        for row in conn.execute(_RESPONSES, {"ids": chunk}):
            found[row.id] = record(row)
    return found


def save_responses(conn: Connection, responses: Sequence[Any]) -> None:
    """Write what a rule changed in these responses (models or records)."""
    if responses:
        conn.execute(
            _SAVE_RESPONSE,
            [
                {"key_id": r.id, **{name: getattr(r, name) for name in _RESPONSE_COLUMNS}}
                for r in responses
            ],
        )


def lookup(conn: Connection, task_id: str) -> LogprobLookup:
    """A message's log-probabilities, from its committed delta events (read when it closes)."""

    def find(item_id: str) -> list[dict[str, Any]]:
        rows = conn.execute(_DELTAS, {"task_id": task_id}).scalars()
        return logprobs_from_events([json.loads(data) for data in rows], item_id)

    return find


def chunks(items: list[Any], size: int) -> list[list[Any]]:
    return [items[i : i + size] for i in range(0, len(items), size)]
