"""A task's life, rule by rule of LMSP section 11.2, each one write transaction.

- `create_task`: a task is persisted (with its first event) before `202 Accepted`;
- `append_events`, `start_running`, `append_output` / `append_outputs`: event sequence numbers
  and the task's state change together (`events.write`);
- `request_cancel`, `finish`: the cancellation transition is atomic: a cancelled task never
  completes, a finished task never changes again;
- `revoke_client`: revoking a paired client cancels its unfinished tasks in the same
  transaction, so none of them runs on, or resumes after a restart.

Each rule reads the task `FOR UPDATE` (PostgreSQL) inside its transaction before changing it
(SQLite's `BEGIN IMMEDIATE` holds the one write lock from the start), so two rules on one task
run one after the other, never interleaved.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Select, bindparam, select, update
from sqlalchemy.engine import Connection

from ...protocol import events as ev
from ...protocol.objects import response_object
from ...protocol.output import Attempt, Batch
from ...protocol.states import RECOVERY_TABLE, TERMINAL_STATES, TaskState
from ...protocol.tools import ToolsSpec
from .. import conversations
from ..database import Database
from ..dialect import insert_of
from ..records import column_values, insert_rows, table
from ..tables import Client, IdempotencyKey, Response, Task
from . import events
from .endings import terminate
from .rows import RESPONSES, TASKS, load, lookup, record, response_of, save_responses
from .types import (
    CLIENT_REVOKED,
    Committed,
    Event,
    EventBuilder,
    Outcome,
    not_found,
    not_held,
)

UNFINISHED = tuple(str(s) for s in RECOVERY_TABLE)

_KEYS = table(IdempotencyKey)


@functools.cache
def _upsert_key(name: str) -> Any:
    """An idempotency record replaces an expired one of the same caller and key (in the
    dialect `name`)."""
    statement = insert_of(name)(_KEYS)
    return statement.on_conflict_do_update(
        index_elements=["caller", "key"],
        set_={
            c.name: statement.excluded[c.name] for c in _KEYS.c if c.name not in ("caller", "key")
        },
    )


_TASKS_FOR_UPDATE = (
    select(TASKS)
    .where(TASKS.c.id.in_(bindparam("ids", expanding=True)))
    .order_by(TASKS.c.id)  # locked in one order: two such transactions never wait crosswise
    .with_for_update()
)
# One task (a single stream's every flush): `==` instead of the expanding IN, whose
# parameters SQLAlchemy re-renders into the statement on each execution (~30 µs a commit).
_TASK_FOR_UPDATE = select(TASKS).where(TASKS.c.id == bindparam("id")).with_for_update()
# Up to a batch of tasks (issue 42: every flush of a batch's tasks): an IN of that many bound
# parameters, built and compiled once per count, for the same reason.
_BATCH_FOR_UPDATE_LIMIT = 64


@functools.cache
def _batch_for_update(n: int) -> Select[Any]:
    return (
        select(TASKS)
        .where(TASKS.c.id.in_([bindparam(f"id{i}") for i in range(n)]))
        .order_by(TASKS.c.id)
        .with_for_update()
    )


_CLIENTS = table(Client)
_CLIENT_FOR_UPDATE = select(_CLIENTS).where(_CLIENTS.c.id == bindparam("id")).with_for_update()
_APPROVED_BY = select(_CLIENTS).where(_CLIENTS.c.approved_by == bindparam("id")).with_for_update()
_REVOKE = (
    update(_CLIENTS)
    .where(_CLIENTS.c.id == bindparam("key_id"))
    .values(revoked_at=bindparam("revoked_at"))
)
_UNFINISHED_OF = (
    select(TASKS)
    .where(
        TASKS.c.owner.in_(bindparam("owners", expanding=True)),
        TASKS.c.state.in_(UNFINISHED),
    )
    .order_by(TASKS.c.created_at)
    .with_for_update()
)


# ---------------------------------------------------------------------------------------------
# 11.2: persist a task before 202


def create_task(
    db: Database,
    task: Task,
    response: Response | None = None,
    idempotency: IdempotencyKey | None = None,
    admit: Callable[[Connection], None] | None = None,
) -> Committed:
    """Insert a task (and its response) with its first event, in one transaction.

    The caller writes `202 Accepted` only after this returns: the task is then on disk. An
    idempotency record, when given, is stored in the same transaction as the work it started.
    `admit`, when given, runs first in the transaction, on its connection, and may raise to
    refuse the task (a quota counted over the tasks already committed, so concurrent creates
    cannot overshoot).
    """
    now = time.time()
    task.state = TaskState.QUEUED
    task.created_at = task.created_at or now
    task.updated_at = now
    task.next_sequence = 0
    with db.writing() as conn:
        if admit is not None:
            admit(conn)
        if response is not None:
            insert_rows(conn, RESPONSES, [column_values(response, Response)])
        first: Event = (
            ev.lifecycle(ev.CREATED, response_object(response, task))
            if response is not None
            else {"type": "task.created", "task_id": task.id}
        )
        events.write(conn, [(task, [first])], now, created=True)
        if idempotency is not None:
            conn.execute(_upsert_key(conn.dialect.name), idempotency.model_dump())
    return Committed(task, response, [first])


# ---------------------------------------------------------------------------------------------
# 11.2: sequence numbers and state in the same transaction


def append_events(
    db: Database,
    task_id: str,
    build: EventBuilder,
    *,
    to_state: TaskState | None = None,
    only_from: Sequence[TaskState] | None = None,
    runner_id: str | None = None,
) -> Committed:
    """Move a task to `to_state` (if given) and append the events `build` returns, atomically.

    `build` sees the task and its response after the state change, so lifecycle events carry
    the new status. With `only_from`, nothing happens unless the task is in one of those states
    (`changed` is then False): the check and the write share the transaction. A `cancelling`
    task is never moved to another state here: once a cancel is accepted, only `finish` ends
    it, and always as `cancelled` (11.2). With `runner_id`, nothing happens unless that runner
    holds the task (`lost` otherwise).
    """
    now = time.time()
    with db.writing() as conn:
        task, response = load(conn, task_id)
        state = TaskState(task.state)
        if not_held(task, runner_id):
            return Committed(task, response, [], changed=False, lost=True)
        if (
            state in TERMINAL_STATES
            or (only_from is not None and state not in only_from)
            or (state == TaskState.CANCELLING and to_state not in (None, TaskState.CANCELLING))
        ):
            return Committed(task, response, [], changed=False)
        if to_state is not None:
            task.state = to_state
        built = build(task, response)
        events.write(conn, [(task, built)], now)
    return Committed(task, response, built)


def start_running(
    db: Database,
    task_id: str,
    input_tokens: int,
    runner_id: str | None = None,
    *,
    n: int | None = None,
    eager: bool | None = None,
) -> Committed:
    """`loading` → `running`, opening the attempt's output (or re-entering it when resuming).

    A task without tools opens its message (one per choice, `n`) at once (`eager`); with tools
    a message opens with the first text (`protocol.output`). The runner passes both from the
    params it parsed at the claim; without them they are read from the task's params. A
    resumed task is already `running` with its attempt open: nothing is appended then, so the
    log goes on from its last committed event.
    """
    now = time.time()
    with db.writing() as conn:
        task, response = load(conn, task_id)
        if not_held(task, runner_id):
            return Committed(task, response, [], changed=False, lost=True)
        state = TaskState(task.state)
        attempt = Attempt.load(task.snapshot)
        if state == TaskState.RUNNING and attempt.open:
            attempt.data["input_tokens"] = input_tokens
            task.snapshot = attempt.dump()
            events.write(conn, [(task, [])], now)
            return Committed(task, response, [], changed=False)
        if state != TaskState.LOADING:
            return Committed(task, response, [], changed=False)
        task.state = TaskState.RUNNING
        if n is None or eager is None:
            params = json.loads(task.params or "{}")
            tools = params.get("tools")
            n = int(params.get("n", 1))
            eager = not (tools and ToolsSpec.from_json(tools).active)
        attempt, opened = Attempt.begin(
            attempt,
            (task.response_id or task.id).split("_", 1)[1],
            input_tokens,
            n=n,
            eager=eager,
        )
        built: list[Event] = []
        if response is not None:
            # Its snapshot is the output before this attempt's messages open: each item
            # appears once its `output_item.added` has (the openai SDKs' stream helpers count
            # an item from that event; the Node one refuses it twice).
            built.append(ev.lifecycle(ev.IN_PROGRESS, response_object(response, task)))
        task.snapshot = attempt.dump()
        built.extend(opened)
        events.write(conn, [(task, built)], now)
    return Committed(task, response, built)


def append_output(
    db: Database,
    task_id: str,
    token_ids: Sequence[int],
    text: str,
    runner_id: str | None = None,
) -> Committed:
    """Append generated text as one delta event, with the snapshot that covers it (LMSP B7)."""
    (committed,) = append_outputs(
        db, {task_id: Batch.plain(list(token_ids), text)}, missing_ok=False, runner_id=runner_id
    )
    return committed


def append_outputs(
    db: Database,
    outputs: Mapping[str, Batch | tuple[Sequence[int], str]],
    *,
    missing_ok: bool = True,
    runner_id: str | None = None,
) -> list[Committed]:
    """`append_output` for several running tasks (task id → the batch of output each
    produced since its last snapshot; `(token ids, text)` for plain text) in one transaction,
    one commit. Each batch's pieces become the task's events (text deltas, function calls, a
    choice's end), written with the snapshot that covers them.

    The hot path: one SELECT for all the tasks (locked in id order on PostgreSQL), then one
    statement for their rows and one for all their events, however many tasks; tasks are
    records, not models (`rows.record`). A task that no longer exists is skipped
    (`missing_ok`), or a 404.
    """
    now = time.time()
    committed: list[Committed] = []
    changes: list[tuple[Any, list[Event]]] = []
    with db.writing() as conn:
        if len(outputs) == 1:
            (only,) = outputs
            rows = conn.execute(_TASK_FOR_UPDATE, {"id": only})
        elif len(outputs) <= _BATCH_FOR_UPDATE_LIMIT:
            rows = conn.execute(
                _batch_for_update(len(outputs)), {f"id{i}": t for i, t in enumerate(outputs)}
            )
        else:
            rows = conn.execute(_TASKS_FOR_UPDATE, {"ids": list(outputs)})
        found = {row.id: row for row in rows}
        for task_id, batch in outputs.items():
            row = found.get(task_id)
            if row is None:
                if missing_ok:
                    continue
                raise not_found(task_id)
            task = record(row)
            if not_held(task, runner_id):
                committed.append(Committed(task, None, [], changed=False, lost=True))
                continue
            attempt = Attempt.load(task.snapshot)
            state = TaskState(task.state)
            if state not in (TaskState.RUNNING, TaskState.CANCELLING) or not attempt.open:
                committed.append(Committed(task, None, [], changed=False))
                continue
            if isinstance(batch, tuple):
                batch = Batch.plain(list(batch[0]), batch[1])
            built = attempt.apply(batch, lookup(conn, task.id))
            task.snapshot = attempt.dump()
            changes.append((task, built))
            committed.append(Committed(task, None, built))
        events.write(conn, changes, now, columns=events.OUTPUT_COLUMNS)
    return committed


# ---------------------------------------------------------------------------------------------
# 11.2: the cancellation transition is atomic


def request_cancel(db: Database, task_id: str, reason: dict[str, str] | None = None) -> Committed:
    """Ask a task to stop: `queued` → `cancelled` at once, `loading`/`running` → `cancelling`.

    A task already finished (or already cancelling) is returned unchanged (`changed` False).
    A `reason` (`{"code", "message"}`) is recorded as the task's and the response's `error`, so
    its events say why it was cancelled when the service, not its client, cancelled it.
    """
    now = time.time()
    with db.writing() as conn:
        task, response = load(conn, task_id)
        built = _cancel(conn, task, response, reason, now)
    return Committed(task, response, built, changed=bool(built))


def _cancel(
    conn: Connection,
    task: Task,
    response: Response | None,
    reason: dict[str, str] | None,
    now: float,
) -> list[Event]:
    state = TaskState(task.state)
    if state in TERMINAL_STATES or state == TaskState.CANCELLING:
        return []
    if reason is not None:
        task.error = json.dumps(reason)
        if response is not None:
            response.error = json.dumps(reason)
    if state == TaskState.QUEUED:
        outcome = Outcome(TaskState.CANCELLED, error=reason)
        built = terminate(task, response, outcome, now, lookup(conn, task.id))
    else:
        task.state = TaskState.CANCELLING
        built = (
            [ev.lifecycle(ev.CANCELLING, response_object(response, task))]
            if response is not None
            else [{"type": "task.cancelling", "task_id": task.id, "error": reason}]
        )
    events.write(conn, [(task, built)], now)
    if response is not None and (reason is not None or state == TaskState.QUEUED):
        save_responses(conn, [response])
    return built


@dataclass
class Revocation:
    """What `revoke_client` changed: the clients revoked (the one asked for first), and every
    task of theirs it cancelled (or moved to `cancelling`)."""

    clients: list[Client]
    committed: list[Committed] = field(default_factory=list)


def revoke_client(db: Database, client_id: str) -> Revocation | None:
    """Revoke a paired client, the clients it approved (and theirs), and cancel every unfinished
    task they own, in one transaction. None if there is no such client.

    Queued tasks end `cancelled` at once; loading and running ones become `cancelling` and end
    `cancelled` when their generation stops (or at the next start-up, by the 11.3 table). Each
    carries the error `client_revoked`. Revoking again cancels whatever is still unfinished.
    """
    now = time.time()
    with db.writing() as conn:
        row = conn.execute(_CLIENT_FOR_UPDATE, {"id": client_id}).first()
        if row is None:
            return None
        revoked: list[Client] = []
        pending = [Client(**row._mapping)]
        while pending:
            current = pending.pop(0)
            if any(c.id == current.id for c in revoked):
                continue
            if current.revoked_at is None:
                current.revoked_at = now
                conn.execute(_REVOKE, {"key_id": current.id, "revoked_at": now})
            revoked.append(current)
            pending.extend(
                Client(**r._mapping) for r in conn.execute(_APPROVED_BY, {"id": current.id})
            )
        result = Revocation(revoked)
        owners = [c.id for c in revoked]
        for task_row in list(conn.execute(_UNFINISHED_OF, {"owners": owners})):
            task = record(task_row)
            response = response_of(conn, task.response_id)
            built = _cancel(conn, task, response, CLIENT_REVOKED, now)
            if built:
                result.committed.append(Committed(task, response, built))
    return result


def finish(db: Database, task_id: str, outcome: Outcome, runner_id: str | None = None) -> Committed:
    """Write a task's terminal state and its one terminal event.

    Once a cancel was accepted (`cancelling`), the task ends `cancelled` whatever the generation
    reports; once a task is terminal, nothing changes it (`changed` False).
    """
    now = time.time()
    with db.writing() as conn:
        task, response = load(conn, task_id)
        state = TaskState(task.state)
        if state in TERMINAL_STATES:
            return Committed(task, response, [], changed=False)
        if not_held(task, runner_id):
            return Committed(task, response, [], changed=False, lost=True)
        if state == TaskState.CANCELLING:
            outcome = Outcome(TaskState.CANCELLED, usage=outcome.usage)
        if outcome.also is not None:
            outcome.also(conn)
        built = end(conn, task, response, outcome, now)
    return Committed(task, response, built)


def end(
    conn: Connection, task: Any, response: Any | None, outcome: Outcome, now: float
) -> list[Event]:
    """End `task` as `outcome` says, on `conn`: its closing events, numbered and written with
    its row, and its response (what `finish` writes; the claim of a `cancelling` task too)."""
    built = terminate(task, response, outcome, now, lookup(conn, task.id))
    events.write(conn, [(task, built)], now)
    if response is not None:
        save_responses(conn, [response])
        # A completed response's turn joins its conversation in this same transaction.
        conversations.join_turn(conn, task, response, now)
    return built
