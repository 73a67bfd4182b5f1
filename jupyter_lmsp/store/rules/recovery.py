"""LMSP 11.3, the recovery table, applied to the tasks left unfinished by runners that are
gone (at start-up, and by every live server's periodic sweep) or by an inference worker that
died: each runner's tasks in one transaction.

`RECOVERY_TABLE` (protocol.states) says, for the state a task was left in and its restart
policy, where it goes: `queued` again, `running` to resume from its snapshot, `failed`, or
`cancelled` (a task that was `cancelling`, whatever its policy). Start-up may find ten thousand
unfinished tasks, so the table is applied on records (`rows.record`), with one statement per
table for all of a runner's tasks (`events.write`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from sqlalchemy import BindParameter, bindparam, delete, literal, select
from sqlalchemy.engine import Connection

from ...protocol import events as ev
from ...protocol.objects import response_object
from ...protocol.states import RECOVERY_TABLE, RestartPolicy, TaskState
from .. import runners
from ..database import Database
from ..records import table
from ..tables import IdempotencyKey, Runner
from . import events
from .endings import close_open_item, terminate
from .lifecycle import UNFINISHED
from .rows import TASKS, chunks, lookup, record, responses_of, save_responses
from .types import SERVER_RESTARTED, WORKER_CRASHED, Committed, Event, Outcome, RecoveryReport
from .types import not_held as _not_held

_UNFINISHED_NOT_QUEUED = tuple(s for s in UNFINISHED if s != TaskState.QUEUED)
_KEYS = table(IdempotencyKey)
_RUNNERS = table(Runner)

_RUNNER_FOR_UPDATE = select(_RUNNERS).where(_RUNNERS.c.id == bindparam("id")).with_for_update()
_DELETE_RUNNER = delete(_RUNNERS).where(_RUNNERS.c.id == bindparam("id"))
# Idempotency keys a runner's requests claimed without committing any work.
_UNUSED_KEYS = delete(_KEYS).where(_KEYS.c.status_code.is_(None), _KEYS.c.response_id.is_(None))
_RELEASE_OF = _UNUSED_KEYS.where(_KEYS.c.runner_id == bindparam("runner_id"))
_RELEASE_UNHELD = _UNUSED_KEYS.where(_KEYS.c.runner_id.is_(None))
_STATES: BindParameter[Any] = bindparam("states", expanding=True)
_TASKS_OF = (
    select(TASKS)
    .where(TASKS.c.runner_id == bindparam("runner_id"), TASKS.c.state.in_(_STATES))
    .order_by(TASKS.c.created_at)
    .with_for_update()
)
_TASKS_UNHELD = (
    select(TASKS)
    .where(TASKS.c.runner_id.is_(None), TASKS.c.state.in_(_STATES))
    .order_by(TASKS.c.created_at)
    .with_for_update()
)
_UNFINISHED_OF_IDS = (
    select(TASKS)
    .where(TASKS.c.id.in_(bindparam("ids", expanding=True)), TASKS.c.state.in_(UNFINISHED))
    .order_by(TASKS.c.id)
    .with_for_update()
)
_ANY_UNHELD_TASK = (
    select(literal(1))
    .select_from(TASKS)
    .where(TASKS.c.runner_id.is_(None), TASKS.c.state.in_(_STATES))
    .limit(1)
)
_ANY_UNHELD_KEY = (
    select(literal(1))
    .select_from(_KEYS)
    .where(_KEYS.c.runner_id.is_(None), _KEYS.c.status_code.is_(None))
    .where(_KEYS.c.response_id.is_(None))
    .limit(1)
)


def recover_at_startup(
    db: Database,
    adopter: str | None = None,
    now: float | None = None,
    *,
    shared_queue: bool = False,
) -> RecoveryReport:
    """Apply the 11.3 table to the tasks left `queued`, `loading`, `running` or `cancelling` by
    runners that are gone, and to unfinished tasks no runner holds.

    A runner is gone when its process provably is (on this machine: no process with its id and
    start time runs) or, elsewhere, when its lease expired (`store.runners`): a restarted
    server recovers its dead predecessor at once, and never touches the tasks of a server that
    still runs. Tasks no runner holds are those of release 0.1.0, or of a runner that stopped
    cleanly. Each runner's tasks are recovered in one transaction (`recover_runner`), committed
    before the service accepts a request; tasks that stay unfinished (queued again, or
    `running` to continue from their snapshot) are adopted by `adopter`, which runs them.

    Every live server also calls this periodically (its sweep), for runners that died since.

    With `shared_queue` (and no `adopter`), surviving tasks go back to the shared queue of
    standalone workers (`claim_tasks`), and queued tasks no runner holds are left there.
    """
    report = RecoveryReport()
    # With `shared_queue` (servers without a local worker, standalone workers), queued tasks
    # no runner holds are the shared queue, which workers claim (`claim_tasks`): left alone.
    states = _UNFINISHED_NOT_QUEUED if shared_queue else UNFINISHED
    if _anything_unheld(db, states):
        report.add(recover_runner(db, None, adopter, states=states))
    for runner, _reason in runners.gone_runners(db, now):
        if runner.id != adopter:
            report.add(recover_runner(db, runner.id, adopter, now=now))
    return report


def recover_runner(
    db: Database,
    runner_id: str | None,
    adopter: str | None = None,
    *,
    now: float | None = None,
    error: dict[str, str] = SERVER_RESTARTED,
    states: Sequence[str] | None = None,
) -> RecoveryReport:
    """The 11.3 table for the unfinished tasks of the runner `runner_id` (None: of no runner),
    in one transaction, provided it is still gone when the transaction holds the write lock
    (a lease renewed meanwhile, or another server's recovery of it, leave nothing to do).

    The same transaction releases idempotency keys the runner's requests had claimed without
    committing any work, hands the surviving tasks to `adopter` and deletes the runner.
    """
    now = time.time() if now is None else now
    report = RecoveryReport()
    examined = list(states or UNFINISHED)
    with db.writing() as conn:
        reason = "unheld"
        if runner_id is not None:
            row = conn.execute(_RUNNER_FOR_UPDATE, {"id": runner_id}).first()
            found = runners.gone_reason(Runner(**row._mapping), now) if row is not None else None
            if found is None:
                return report  # alive after all, or already recovered by someone else
            reason = found
        report.runners.append((runner_id, reason))
        if runner_id is None:
            report.released_claims = conn.execute(_RELEASE_UNHELD).rowcount
            rows = conn.execute(_TASKS_UNHELD, {"states": examined})
        else:
            report.released_claims = conn.execute(_RELEASE_OF, {"runner_id": runner_id}).rowcount
            rows = conn.execute(_TASKS_OF, {"runner_id": runner_id, "states": examined})
        _apply_table(conn, [record(r) for r in rows], error, now, report, adopter=adopter)
        if runner_id is not None:
            conn.execute(_DELETE_RUNNER, {"id": runner_id})
    return report


def recover_after_worker_exit(
    db: Database, task_ids: Sequence[str], runner_id: str | None = None
) -> RecoveryReport:
    """The same table for the tasks an inference worker held when it died: the service did
    not restart, but their generation did, so each follows its restart policy. With
    `runner_id`, only the tasks that runner holds; survivors stay its own."""
    if not task_ids:
        return RecoveryReport()
    now = time.time()
    report = RecoveryReport()
    with db.writing() as conn:
        found: list[Any] = []
        for chunk in chunks(list(task_ids), 500):  # locked in id order, chunk by chunk
            found += [record(r) for r in conn.execute(_UNFINISHED_OF_IDS, {"ids": chunk})]
        found.sort(key=lambda t: t.created_at)
        tasks = [t for t in found if not _not_held(t, runner_id)]
        _apply_table(conn, tasks, WORKER_CRASHED, now, report, adopter=runner_id)
    return report


def _anything_unheld(db: Database, states: Sequence[str] = UNFINISHED) -> bool:
    """Whether some task in `states`, or some claimed idempotency key, has no runner (a cheap
    read, so the periodic sweep takes no write lock when there is nothing to do)."""
    with db.reading() as conn:
        return (
            conn.execute(_ANY_UNHELD_TASK, {"states": list(states)}).first() is not None
            or conn.execute(_ANY_UNHELD_KEY).first() is not None
        )


def _apply_table(
    conn: Connection,
    tasks: list[Any],
    error: dict[str, str],
    now: float,
    report: RecoveryReport,
    *,
    adopter: str | None,
) -> None:
    """The 11.3 table for `tasks` (unfinished records, oldest first), written with one
    statement per table; surviving tasks are given to `adopter`."""
    responses = responses_of(conn, [t.response_id for t in tasks if t.response_id])
    changes: list[tuple[Any, list[Event]]] = []
    changed_responses: list[Any] = []
    for task in tasks:
        report.examined += 1
        found_state = TaskState(task.state)
        target = RECOVERY_TABLE[found_state][RestartPolicy(task.on_restart)]
        key = f"{found_state}->{target}"
        report.transitions[key] = report.transitions.get(key, 0) + 1
        by = (str(found_state), str(task.on_restart), str(target))
        report.by_policy[by] = report.by_policy.get(by, 0) + 1
        response = responses.get(task.response_id) if task.response_id else None
        adopted = False
        if target in (TaskState.QUEUED, TaskState.RUNNING):
            report.adopted.append(task.id)
            report.owners[task.id] = task.owner
            if task.runner_id != adopter:
                task.runner_id = adopter
                adopted = True
            if found_state in (TaskState.LOADING, TaskState.RUNNING):
                # Its run was interrupted and it is taken up again (retried or resumed).
                task.attempts += 1
                adopted = True
        if target == found_state:
            if adopted:
                changes.append((task, []))
            continue
        if target in (TaskState.FAILED, TaskState.CANCELLED):
            outcome = Outcome(target, error=dict(error) if target == TaskState.FAILED else None)
            built = terminate(task, response, outcome, now, lookup(conn, task.id))
            if response is not None:
                changed_responses.append(response)
        else:  # back to queued (loading → queued, or running → queued under `retry`)
            built = close_open_item(task, "incomplete", lookup(conn, task.id))
            task.state = TaskState.QUEUED
            built.append(
                ev.lifecycle(ev.QUEUED, response_object(response, task))
                if response is not None
                else {"type": "task.queued", "task_id": task.id}
            )
        changes.append((task, built))
        report.committed.append(Committed(task, response, built))
    events.write(conn, changes, now)
    save_responses(conn, changed_responses)
