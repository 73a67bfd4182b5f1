"""The shared queue: tasks no runner holds, claimed by the runners that execute them, and the
claim of one task to run (LMSP B12).

A server without a local inference worker creates its tasks held by no runner; standalone
workers take them with `claim_tasks` (on PostgreSQL `FOR UPDATE SKIP LOCKED`, so workers that
claim at once take different tasks without waiting for each other; on SQLite the write
transaction already excludes them). A runner then starts each task it holds with
`claim_to_run`: one transaction that reads the task and moves it to `loading`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import bindparam, select, update

from ...protocol import events as ev
from ...protocol.objects import response_object
from ...protocol.states import TERMINAL_STATES, TaskState
from ..database import Database
from ..tables import Response, Task
from . import events
from .lifecycle import end
from .rows import TASKS, load_if_any
from .types import Committed, Event, Outcome, not_held

_CLAIMABLE = (
    select(TASKS.c.id, TASKS.c.owner)
    .where(
        TASKS.c.runner_id.is_(None),
        TASKS.c.kind == "response",
        TASKS.c.state.in_([str(TaskState.QUEUED), str(TaskState.RUNNING)]),
    )
    .order_by(TASKS.c.created_at)
    .limit(bindparam("limit"))
)
_CLAIMABLE_ANY = _CLAIMABLE.with_for_update(skip_locked=True)
_CLAIMABLE_OF = _CLAIMABLE.where(
    TASKS.c.model.in_(bindparam("models", expanding=True))
).with_for_update(skip_locked=True)
_HOLD = (
    update(TASKS)
    .where(TASKS.c.id == bindparam("key_id"))
    .values(runner_id=bindparam("runner_id"), updated_at=bindparam("updated_at"))
)


def claim_tasks(
    db: Database, runner_id: str, models: Sequence[str] | None = None, limit: int = 1
) -> list[tuple[str, str]]:
    """Take up to `limit` response tasks no runner holds — queued, or `running` to resume (a
    recovery put them back) — for the runner `runner_id`, oldest first, of `models` (every
    model when None): each becomes that runner's in this transaction. Returns (task id,
    owner) pairs."""
    if limit <= 0:
        return []
    now = time.time()
    with db.writing() as conn:
        if models:
            rows = conn.execute(_CLAIMABLE_OF, {"limit": limit, "models": list(models)})
        else:
            rows = conn.execute(_CLAIMABLE_ANY, {"limit": limit})
        claimed = [(row.id, row.owner) for row in rows]
        if claimed:
            conn.execute(
                _HOLD,
                [{"key_id": tid, "runner_id": runner_id, "updated_at": now} for tid, _ in claimed],
            )
    return claimed


@dataclass
class Claim:
    """What claiming a task to run found, committed in one transaction."""

    task: Task | None  # as committed (None: no such task)
    response: Response | None
    committed: list[Committed]  # what to publish (the `loading` event, or the cancelled end)
    run: bool  # True: hand it to the engine now
    resume: bool  # True: it was `running` (resumed from its snapshot)


def claim_to_run(db: Database, task_id: str, runner_id: str | None) -> Claim:
    """Take a task to run, in one write transaction with the task row locked.

    `queued` → `loading` (with its `response.loading`, or `task.loading`, event): run it.
    `running` (a recovery left it to resume from its snapshot): run it, nothing appended.
    `cancelling` (cancelled while it waited to resume): it ends `cancelled` here, as `finish`
    would end it, and does not run. A task another runner holds, a terminal one or none at all:
    nothing changes, nothing runs. Reading the state and moving it share the transaction, so a
    cancel that lands meanwhile is seen either before (the task does not run) or after (the
    runner finds it `cancelling` while it runs).
    """
    now = time.time()
    with db.writing() as conn:
        found = load_if_any(conn, task_id)
        if found is None:
            return Claim(None, None, [], run=False, resume=False)
        task, response = found
        state = TaskState(task.state)
        if not_held(task, runner_id) or state in TERMINAL_STATES:
            return Claim(task, response, [], run=False, resume=False)
        if state == TaskState.RUNNING:
            return Claim(task, response, [], run=True, resume=True)
        if state == TaskState.CANCELLING:
            built = end(conn, task, response, Outcome(TaskState.CANCELLED), now)
            return Claim(task, response, [Committed(task, response, built)], False, False)
        if state != TaskState.QUEUED:
            return Claim(task, response, [], run=False, resume=False)  # `loading`: claimed
        task.state = TaskState.LOADING
        loading: Event = (
            ev.lifecycle(ev.LOADING, response_object(response, task))
            if response is not None
            else {"type": "task.loading", "task_id": task.id}
        )
        events.write(conn, [(task, [loading])], now)
    return Claim(task, response, [Committed(task, response, [loading])], run=True, resume=False)
