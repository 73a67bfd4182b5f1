"""The one writer of `task_events` rows: every rule that appends events goes through `write`.

LMSP 11.2, "event sequence numbers and task state in one transaction": `write` numbers a task's
new events from its `next_sequence`, and writes them together with the task's row (its state,
snapshot, error, `next_sequence`, times and runner), on the rule's connection, inside the
rule's transaction. A task's row is never written without the events that explain it, nor
events without the row that counts them, because nothing else in the store writes either.

A response's terminal event also goes to the owner's webhook endpoints: `write` hands it to
`webhooks.enqueue`, which writes its outbox rows on the same connection (issue 38).

Several tasks at once (`append_outputs`, recovery) take one `executemany` per table: one
statement for the task rows, one for all their events.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Update, bindparam, update
from sqlalchemy.engine import Connection

from ...protocol.webhooks import WEBHOOK_EVENT_TYPES
from .. import webhooks
from ..records import column_values, insert_rows
from ..tables import Task
from .rows import EVENTS, TASKS
from .types import Event

# The columns of a task a rule may change (the rest are fixed when it is created).
TASK_COLUMNS = (
    "state",
    "snapshot",
    "error",
    "next_sequence",
    "updated_at",
    "finished_at",
    "runner_id",
    # Runs interrupted and taken up again (recovery counts them).
    "attempts",
)
# What appending output changes (the hot path: SQLAlchemy's work grows with the columns set,
# ~5 µs per task and column, more than SQLite's own for the statement).
OUTPUT_COLUMNS = ("snapshot", "next_sequence", "updated_at")


def _update(columns: tuple[str, ...]) -> Update:
    return (
        update(TASKS)
        .where(TASKS.c.id == bindparam("key_id"))
        .values({name: bindparam(name) for name in columns})
    )


_UPDATES: dict[tuple[str, ...], Update] = {c: _update(c) for c in (TASK_COLUMNS, OUTPUT_COLUMNS)}


def write(
    conn: Connection,
    changes: Sequence[tuple[Any, list[Event]]],
    now: float,
    *,
    created: bool = False,
    columns: tuple[str, ...] = TASK_COLUMNS,
) -> None:
    """Number each task's `events` (in place: each gets its `sequence_number`) and write the
    tasks' rows and the events' rows. A task with no new events is written all the same (its
    claim, its snapshot). `created`: the tasks are new, their rows inserted whole; otherwise
    `columns` are the ones written (`OUTPUT_COLUMNS` when only output was appended).

    The task rows go first and the events last, so that should an event's row fail (a
    constraint) the statement raises with every change of the transaction still to roll back.
    """
    task_rows: list[dict[str, Any]] = []
    event_rows: list[dict[str, Any]] = []
    ended: list[tuple[str, str, Event]] = []
    for task, events in changes:
        # Counted in a local and set once: an attribute set on a table model costs ~20 µs.
        sequence = task.next_sequence
        task_id = task.id
        for event in events:
            event["sequence_number"] = sequence
            event_rows.append(
                {
                    "task_id": task_id,
                    "sequence_number": sequence,
                    "type": event["type"],
                    "data": json.dumps(event, separators=(",", ":")),
                    "created_at": now,
                }
            )
            sequence += 1
            if event["type"] in WEBHOOK_EVENT_TYPES and task.response_id:
                ended.append((task.owner, task.response_id, event))
        if events:
            task.next_sequence = sequence
        if task.updated_at != now:
            task.updated_at = now
        if created:
            task_rows.append(column_values(task, Task))
        else:
            values = {name: getattr(task, name) for name in columns}
            if "state" in values:
                values["state"] = str(values["state"])
            values["key_id"] = task.id
            task_rows.append(values)
    if task_rows:
        if created:
            insert_rows(conn, TASKS, task_rows)
        else:
            conn.execute(_UPDATES[columns], task_rows)
    insert_rows(conn, EVENTS, event_rows)
    if ended:
        webhooks.enqueue(conn, ended, now)
