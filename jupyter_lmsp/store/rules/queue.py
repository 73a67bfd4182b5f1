"""The shared queue: tasks no runner holds, claimed by the runners that execute them, and the
claim of one task to run (LMSP B12).

A server without a local inference worker creates its tasks held by no runner; standalone
workers take them with `claim_tasks` (on PostgreSQL `FOR UPDATE SKIP LOCKED`, so workers that
claim at once take different tasks without waiting for each other; on SQLite the write
transaction already excludes them). A runner then starts each task it holds with
`claim_to_run`: one transaction that reads the task and moves it to `loading`.

A claim may name the prompt cache keys its worker served recently (`prefer`): every worker
process has its own prompt cache, so a task whose `prompt_cache_key` (`tasks.cache_key`) a
worker served is cheaper there. The preference is a head start, not a priority: in the claim's
order a task of a preferred key counts as created `PREFER_HEAD_START` seconds before it was.
So a preferred task goes before the older tasks of other keys created less than that long
before it, and never before one created that long or longer before it: no task waits behind
preferred tasks created `PREFER_HEAD_START` seconds or more after it, however many keep coming
(a bound in time that holds whatever the claims' sizes and rates, where a bound in tasks per
claim would not). Among the preferred tasks, and among the others, the oldest go first.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Float, Select, bindparam, case, select, update

from ...protocol import events as ev
from ...protocol.objects import response_object
from ...protocol.states import TERMINAL_STATES, TaskState
from ..database import Database
from ..tables import Response, Task
from . import events
from .lifecycle import end
from .rows import TASKS, load_if_any
from .types import Committed, Event, Outcome, not_held

# How many seconds older than it is a task of a preferred key counts in a claim's order: of the
# order of the prefill a prompt cache hit saves (a cold 484-token prompt took 2.7 s on these
# CPUs; the clients that send keys, coding agents, send prompts many times longer), so a task
# is passed over for a cache hit for no longer than such a hit saves.
PREFER_HEAD_START = 10.0


@dataclass(frozen=True)
class Claimed:
    """A task `claim_tasks` took: its id, its owner and its prompt cache key (or None)."""

    task_id: str
    owner: str
    cache_key: str | None = None

    def __iter__(self) -> Iterator[str]:
        """Unpacks as (task id, owner), as a claim's pairs did before keys."""
        return iter((self.task_id, self.owner))


def _claimable(*, of_models: bool, preferring: bool) -> Select:
    claimable = select(TASKS.c.id, TASKS.c.owner, TASKS.c.cache_key).where(
        TASKS.c.runner_id.is_(None),
        TASKS.c.kind == "response",
        TASKS.c.state.in_([str(TaskState.QUEUED), str(TaskState.RUNNING)]),
    )
    if of_models:
        claimable = claimable.where(TASKS.c.model.in_(bindparam("models", expanding=True)))
    if preferring:
        preferred = TASKS.c.cache_key.in_(bindparam("prefer", expanding=True))
        head_start = case((preferred, bindparam("head_start", type_=Float)), else_=0.0)
        # Oldest first once each preferred task's head start is counted; the same order
        # within the preferred tasks and within the others.
        claimable = claimable.order_by(TASKS.c.created_at - head_start, TASKS.c.created_at)
    else:
        claimable = claimable.order_by(TASKS.c.created_at)
    return claimable.limit(bindparam("limit")).with_for_update(skip_locked=True)


_CLAIMABLE = {
    (of_models, preferring): _claimable(of_models=of_models, preferring=preferring)
    for of_models in (False, True)
    for preferring in (False, True)
}
_HOLD = (
    update(TASKS)
    .where(TASKS.c.id == bindparam("key_id"))
    .values(runner_id=bindparam("runner_id"), updated_at=bindparam("updated_at"))
)


def claim_tasks(
    db: Database,
    runner_id: str,
    models: Sequence[str] | None = None,
    limit: int = 1,
    prefer: Collection[str] = (),
    head_start: float = PREFER_HEAD_START,
) -> list[Claimed]:
    """Take up to `limit` response tasks no runner holds — queued, or `running` to resume (a
    recovery put them back) — for the runner `runner_id`, of `models` (every model when None):
    each becomes that runner's in this transaction. Oldest first, except that a task whose
    cache key is in `prefer` counts as created `head_start` seconds earlier than it was (see
    the module's docstring for the bound this keeps)."""
    if limit <= 0:
        return []
    now = time.time()
    params: dict[str, Any] = {"limit": limit}
    if models:
        params["models"] = list(models)
    if prefer:
        params["prefer"] = list(prefer)
        params["head_start"] = head_start
    with db.writing() as conn:
        rows = conn.execute(_CLAIMABLE[bool(models), bool(prefer)], params)
        claimed = [Claimed(row.id, row.owner, row.cache_key) for row in rows]
        if claimed:
            conn.execute(
                _HOLD,
                [{"key_id": c.task_id, "runner_id": runner_id, "updated_at": now} for c in claimed],
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
