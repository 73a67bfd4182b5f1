"""The rules of LMSP section 11.2 and the start-up recovery of 11.3, one transaction each.

Every public function here is one write transaction (`BEGIN IMMEDIATE` on SQLite; on
PostgreSQL one that locks the rows it reads before changing them, `SELECT … FOR UPDATE`),
named after the rule it keeps:

- `create_task`          — a task is persisted (with its first event) before `202 Accepted`;
- `append_events`, `start_running`, `append_output` (`append_outputs` for several tasks)
                         — event sequence numbers and the task's state change together;
- `request_cancel`, `finish`
                         — the cancellation transition is atomic: a cancelled task never
                           completes, a finished task never changes again;
- `revoke_client`        — revoking a paired client cancels its unfinished tasks in the same
                           transaction, so none of them runs on, or resumes after a restart;
- `purge_expired`        — finished tasks and their events are kept for the retention period,
                           unfinished tasks are never deleted;
- `recover_at_startup`   — the 11.3 table, applied to the tasks left unfinished by runners that
                           are gone (and to tasks no runner holds), one runner per transaction;
                           `recover_runner` does one of them.

Who drives a task (LMSP B12): an unfinished task names its runner (`tasks.runner_id`, set by
the transaction that creates or adopts it, cleared by the one that ends it). The functions a
runner calls to drive a task take its `runner_id` and change nothing in a task another runner
holds (the result says `lost`): a runner declared dead while it still ran can never write
over the runner that adopted its tasks. Anyone may cancel any task (`request_cancel`); the
runner holding it sees the `cancelling` state and stops the generation.

The functions return plain values (rows detached from their session, committed event dicts),
so callers publish exactly what was committed.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, cast

from sqlalchemy import CursorResult, Delete, delete, insert, select
from sqlmodel import Session, col

from ..protocol import events as ev
from ..protocol.errors import LMSPError
from ..protocol.objects import response_object
from ..protocol.output import Attempt, Batch, LogprobLookup, logprobs_from_events
from ..protocol.states import (
    RECOVERY_TABLE,
    TERMINAL_STATES,
    RestartPolicy,
    TaskState,
)
from ..protocol.tools import ToolsSpec
from . import runners
from .database import Database
from .dialect import Cursor, dialect_of, for_update
from .tables import Client, IdempotencyKey, Response, Task, TaskEvent

Event = dict[str, Any]
EventBuilder = Callable[[Task, Response | None], list[Event]]

SERVER_RESTARTED = {
    "code": "server_restarted",
    "message": "The service restarted while this task was unfinished, and its policy is 'fail'.",
}
WORKER_CRASHED = {
    "code": "worker_crashed",
    "message": "The inference worker stopped while running this task, and its policy is 'fail'.",
}
CLIENT_REVOKED = {
    "code": "client_revoked",
    "message": "The client that created this task was revoked; its unfinished tasks are cancelled.",
}


@dataclass
class Committed:
    """What one transaction changed: the task as committed and the events it appended.

    From the plain-SQL paths (`append_outputs`, recovery) `task` and `response` are records with
    the table models' attributes rather than the models themselves: values to read, not rows
    to save.
    """

    task: Task
    response: Response | None
    events: list[Event] = field(default_factory=list)
    changed: bool = True
    # The runner that asked no longer holds the task: another runner adopted it (this one was
    # declared dead), or it ended. The caller stops driving it.
    lost: bool = False


@dataclass
class Outcome:
    """How a generation ended, as the runner reports it to `finish`."""

    state: TaskState
    error: dict[str, Any] | None = None
    incomplete_reason: str | None = None
    usage: dict[str, Any] | None = None
    # What a task that is not a response produced (a registered model), shown in its terminal
    # event; `also` writes it durably, in the same transaction, if the task ends as reported.
    result: dict[str, Any] | None = None
    also: Callable[[Any], None] | None = None


@dataclass
class RecoveryReport:
    examined: int = 0
    released_claims: int = 0
    transitions: dict[str, int] = field(default_factory=dict)
    committed: list[Committed] = field(default_factory=list)
    # The runners whose tasks were recovered (None: tasks no runner held), with why.
    runners: list[tuple[str | None, str]] = field(default_factory=list)
    # Unfinished tasks the recovering runner now holds (queued again, or `running` to resume),
    # and whose each of them is.
    adopted: list[str] = field(default_factory=list)
    owners: dict[str, str] = field(default_factory=dict)
    # The tasks examined by (state found, restart policy, state left in), for the metrics.
    by_policy: dict[tuple[str, str, str], int] = field(default_factory=dict)

    def add(self, other: RecoveryReport) -> None:
        self.examined += other.examined
        self.released_claims += other.released_claims
        for key, n in other.transitions.items():
            self.transitions[key] = self.transitions.get(key, 0) + n
        for key3, n in other.by_policy.items():
            self.by_policy[key3] = self.by_policy.get(key3, 0) + n
        self.committed.extend(other.committed)
        self.runners.extend(other.runners)
        self.adopted.extend(other.adopted)
        self.owners.update(other.owners)


# ---------------------------------------------------------------------------------------------
# 11.2: persist a task before 202


def create_task(
    db: Database,
    task: Task,
    response: Response | None = None,
    idempotency: IdempotencyKey | None = None,
    admit: Callable[[Cursor], None] | None = None,
) -> Committed:
    """Insert a task (and its response) with its first event, in one transaction.

    The caller writes `202 Accepted` only after this returns: the task is then on disk. An
    idempotency record, when given, is stored in the same transaction as the work it started.
    `admit`, when given, runs first in the transaction and may raise to refuse the task (a
    quota counted over the tasks already committed, so concurrent creates cannot overshoot).
    """
    now = time.time()
    task.state = TaskState.QUEUED
    task.created_at = task.created_at or now
    task.updated_at = now
    first: Event = (
        ev.lifecycle(ev.CREATED, response_object(response, task))
        if response is not None
        else {"type": "task.created", "task_id": task.id}
    )
    first["sequence_number"] = 0
    task.next_sequence = 1
    # Plain SQL on a DB-API cursor (no ORM session): this runs once per created task, on the
    # request's path to its 202, and SQLAlchemy's per-statement work would be a third of it.
    with db.write_cursor() as cursor:
        if admit is not None:
            admit(cursor)
        if response is not None:
            _insert(cursor, "responses", response.model_dump())
        _insert(cursor, "tasks", task.model_dump())
        _insert(
            cursor,
            "task_events",
            {
                "task_id": task.id,
                "sequence_number": 0,
                "type": first["type"],
                "data": json.dumps(first, separators=(",", ":")),
                "created_at": now,
            },
        )
        if idempotency is not None:
            values = idempotency.model_dump()
            updates = ", ".join(f"{k} = excluded.{k}" for k in values if k not in ("caller", "key"))
            _insert(
                cursor,
                "idempotency_keys",
                values,
                f" ON CONFLICT (caller, key) DO UPDATE SET {updates}",
            )
    return Committed(task, response, [first])


# ---------------------------------------------------------------------------------------------
# the shared queue: tasks no runner holds, claimed by the runners that execute them


def claim_tasks(
    db: Database, runner_id: str, models: Sequence[str] | None = None, limit: int = 1
) -> list[tuple[str, str]]:
    """Take up to `limit` response tasks no runner holds — queued, or `running` to resume (a
    recovery put them back) — for the runner `runner_id`, oldest first, of `models` (every
    model when None): each becomes that runner's in this transaction. Returns (task id,
    owner) pairs.

    The shared queue of standalone inference workers (LMSP B12): a server without a local
    worker creates its tasks held by no runner. On PostgreSQL the candidates are locked with
    `FOR UPDATE SKIP LOCKED`, so workers claiming at once take different tasks without
    waiting for each other; on SQLite the write transaction already excludes them.
    """
    if limit <= 0:
        return []
    now = time.time()
    wanted = list(models) if models else []
    by_model = f" AND model IN ({', '.join('?' * len(wanted))})" if wanted else ""
    with db.write_cursor() as cursor:
        skip = " FOR UPDATE SKIP LOCKED" if for_update(dialect_of(cursor)) else ""
        rows = cursor.execute(
            "SELECT id, owner FROM tasks WHERE runner_id IS NULL AND kind = 'response'"
            f" AND state IN (?, ?){by_model} ORDER BY created_at LIMIT ?{skip}",
            (str(TaskState.QUEUED), str(TaskState.RUNNING), *wanted, limit),
        ).fetchall()
        claimed = [(row[0], row[1]) for row in rows]
        cursor.executemany(
            "UPDATE tasks SET runner_id = ?, updated_at = ? WHERE id = ?",
            [(runner_id, now, task_id) for task_id, _ in claimed],
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
    with db.write() as session:
        task = session.get(Task, task_id, with_for_update=True)
        if task is None:
            return Claim(None, None, [], run=False, resume=False)
        response = session.get(Response, task.response_id) if task.response_id else None
        state = TaskState(task.state)
        if _not_held(task, runner_id) or state in TERMINAL_STATES:
            return Claim(task, response, [], run=False, resume=False)
        if state == TaskState.RUNNING:
            return Claim(task, response, [], run=True, resume=True)
        if state == TaskState.CANCELLING:
            outcome = Outcome(TaskState.CANCELLED)
            built = _terminate(task, response, outcome, now, _session_lookup(session, task.id))
            events = _append(session, task, built, now)
            return Claim(task, response, [Committed(task, response, events)], False, False)
        if state != TaskState.QUEUED:
            return Claim(task, response, [], run=False, resume=False)  # `loading`: claimed
        task.state = TaskState.LOADING
        loading: Event = (
            ev.lifecycle(ev.LOADING, response_object(response, task))
            if response is not None
            else {"type": "task.loading", "task_id": task.id}
        )
        events = _append(session, task, [loading], now)
    return Claim(task, response, [Committed(task, response, events)], run=True, resume=False)


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
    with db.write() as session:
        task, response = _load(session, task_id)
        state = TaskState(task.state)
        if _not_held(task, runner_id):
            return Committed(task, response, [], changed=False, lost=True)
        if (
            state in TERMINAL_STATES
            or (only_from is not None and state not in only_from)
            or (state == TaskState.CANCELLING and to_state not in (None, TaskState.CANCELLING))
        ):
            return Committed(task, response, [], changed=False)
        if to_state is not None:
            task.state = to_state
        events = _append(session, task, build(task, response), now)
    return Committed(task, response, events)


def start_running(
    db: Database, task_id: str, input_tokens: int, runner_id: str | None = None
) -> Committed:
    """`loading` → `running`, opening the attempt's output (or re-entering it when resuming).

    A task without tools opens its message (one per choice) at once; with tools a message
    opens with the first text (`protocol.output`). A resumed task is already `running` with
    its attempt open: nothing is appended then, so the log goes on from its last committed
    event.
    """
    now = time.time()
    with db.write() as session:
        task, response = _load(session, task_id)
        if _not_held(task, runner_id):
            return Committed(task, response, [], changed=False, lost=True)
        state = TaskState(task.state)
        attempt = Attempt.load(task.snapshot)
        if state == TaskState.RUNNING and attempt.open:
            attempt.data["input_tokens"] = input_tokens
            task.snapshot = attempt.dump()
            task.updated_at = now
            return Committed(task, response, [], changed=False)
        if state != TaskState.LOADING:
            return Committed(task, response, [], changed=False)
        task.state = TaskState.RUNNING
        params = json.loads(task.params or "{}")
        tools = params.get("tools")
        attempt, opened = Attempt.begin(
            attempt,
            (task.response_id or task.id).split("_", 1)[1],
            input_tokens,
            n=int(params.get("n", 1)),
            eager=not (tools and ToolsSpec.from_json(tools).active),
        )
        task.snapshot = attempt.dump()
        built: list[Event] = []
        if response is not None:
            built.append(ev.lifecycle(ev.IN_PROGRESS, response_object(response, task)))
        built.extend(opened)
        events = _append(session, task, built, now)
    return Committed(task, response, events)


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
    one commit. Each batch's pieces
    become the task's events (text deltas, function calls, a choice's end), written with the
    snapshot that covers them.

    This is the hot path, so it is plain SQL on a DB-API cursor rather than the ORM: per task
    one SELECT, one INSERT, one UPDATE, all in one BEGIN IMMEDIATE transaction. A task that no
    longer exists is skipped (`missing_ok`), or a 404.
    """
    now = time.time()
    committed: list[Committed] = []
    with db.write_cursor() as cursor:
        locking = for_update(dialect_of(cursor))
        if locking and len(outputs) > 1:
            # Locked first, all in one order (by id): two transactions locking several of the
            # same tasks then never wait for each other crosswise.
            ids = sorted(outputs)
            cursor.execute(
                f"SELECT id FROM tasks WHERE id IN ({', '.join('?' * len(ids))})"
                " ORDER BY id FOR UPDATE",
                ids,
            )
        for task_id, batch in outputs.items():
            row = cursor.execute(
                "SELECT * FROM tasks WHERE id = ?" + locking, (task_id,)
            ).fetchone()
            if row is None:
                if missing_ok:
                    continue
                raise LMSPError(
                    404, "not_found", f"No task with id '{task_id}' found.", type="not_found_error"
                )
            task = _record(row)
            if _not_held(task, runner_id):
                committed.append(Committed(task, None, [], changed=False, lost=True))
                continue
            if isinstance(batch, tuple):
                batch = Batch.plain(list(batch[0]), batch[1])
            committed.append(_append_output(cursor, task, batch, now))
    return committed


def _append_output(cursor: Cursor, task: Any, batch: Batch, now: float) -> Committed:
    attempt = Attempt.load(task.snapshot)
    if TaskState(task.state) not in (TaskState.RUNNING, TaskState.CANCELLING) or not attempt.open:
        return Committed(task, None, [], changed=False)
    events = attempt.apply(batch, _cursor_lookup(cursor, task.id))
    task.snapshot = attempt.dump()
    for event in events:
        event["sequence_number"] = task.next_sequence
        cursor.execute(
            "INSERT INTO task_events (task_id, sequence_number, type, data, created_at)"
            " VALUES (?, ?, ?, ?, ?)",
            (
                task.id,
                task.next_sequence,
                event["type"],
                json.dumps(event, separators=(",", ":")),
                now,
            ),
        )
        task.next_sequence += 1
    task.updated_at = now
    cursor.execute(
        "UPDATE tasks SET snapshot = ?, next_sequence = ?, updated_at = ? WHERE id = ?",
        (task.snapshot, task.next_sequence, now, task.id),
    )
    return Committed(task, None, events)


_DELTAS = "SELECT data FROM task_events WHERE task_id = ? AND type = ? ORDER BY sequence_number"


def _cursor_lookup(cursor: Cursor, task_id: str) -> LogprobLookup:
    """A message's log-probabilities, from its committed delta events (read when it closes)."""

    def lookup(item_id: str) -> list[dict[str, Any]]:
        rows = cursor.execute(_DELTAS, (task_id, ev.TEXT_DELTA)).fetchall()
        return logprobs_from_events([json.loads(row[0]) for row in rows], item_id)

    return lookup


def _session_lookup(session: Session, task_id: str) -> LogprobLookup:
    def lookup(item_id: str) -> list[dict[str, Any]]:
        rows = session.execute(
            select(col(TaskEvent.data))
            .where(col(TaskEvent.task_id) == task_id, col(TaskEvent.type) == ev.TEXT_DELTA)
            .order_by(col(TaskEvent.sequence_number))
        ).scalars()
        return logprobs_from_events([json.loads(data) for data in rows], item_id)

    return lookup


# ---------------------------------------------------------------------------------------------
# 11.2: the cancellation transition is atomic


def request_cancel(db: Database, task_id: str, reason: dict[str, str] | None = None) -> Committed:
    """Ask a task to stop: `queued` → `cancelled` at once, `loading`/`running` → `cancelling`.

    A task already finished (or already cancelling) is returned unchanged (`changed` False).
    A `reason` (`{"code", "message"}`) is recorded as the task's and the response's `error`, so
    its events say why it was cancelled when the service, not its client, cancelled it.
    """
    now = time.time()
    with db.write() as session:
        task, response = _load(session, task_id)
        events = _cancel(session, task, response, reason, now)
    return Committed(task, response, events, changed=bool(events))


def _cancel(
    session: Session,
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
            session.add(response)
    if state == TaskState.QUEUED:
        built = _terminate(
            task,
            response,
            Outcome(TaskState.CANCELLED, error=reason),
            now,
            _session_lookup(session, task.id),
        )
    else:
        task.state = TaskState.CANCELLING
        built = (
            [ev.lifecycle(ev.CANCELLING, response_object(response, task))]
            if response is not None
            else [{"type": "task.cancelling", "task_id": task.id, "error": reason}]
        )
    return _append(session, task, built, now)


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
    with db.write() as session:
        client = session.get(Client, client_id, with_for_update=True)
        if client is None:
            return None
        revoked: list[Client] = []
        pending = [client]
        while pending:
            current = pending.pop(0)
            if any(c.id == current.id for c in revoked):
                continue
            if current.revoked_at is None:
                current.revoked_at = now
                session.add(current)
            revoked.append(current)
            approved = select(Client).where(col(Client.approved_by) == current.id).with_for_update()
            pending.extend(session.execute(approved).scalars())
        result = Revocation(revoked)
        owners = [c.id for c in revoked]
        unfinished = select(Task).where(
            col(Task.owner).in_(owners), col(Task.state).in_(_UNFINISHED)
        )
        unfinished = unfinished.order_by(col(Task.created_at)).with_for_update()
        for task in list(session.execute(unfinished).scalars()):
            response = session.get(Response, task.response_id) if task.response_id else None
            events = _cancel(session, task, response, CLIENT_REVOKED, now)
            if events:
                result.committed.append(Committed(task, response, events))
    return result


def finish(db: Database, task_id: str, outcome: Outcome, runner_id: str | None = None) -> Committed:
    """Write a task's terminal state and its one terminal event.

    Once a cancel was accepted (`cancelling`), the task ends `cancelled` whatever the generation
    reports; once a task is terminal, nothing changes it (`changed` False).
    """
    now = time.time()
    with db.write() as session:
        task, response = _load(session, task_id)
        state = TaskState(task.state)
        if state in TERMINAL_STATES:
            return Committed(task, response, [], changed=False)
        if _not_held(task, runner_id):
            return Committed(task, response, [], changed=False, lost=True)
        if state == TaskState.CANCELLING:
            outcome = Outcome(TaskState.CANCELLED, usage=outcome.usage)
        if outcome.also is not None:
            outcome.also(session)
        built = _terminate(task, response, outcome, now, _session_lookup(session, task.id))
        events = _append(session, task, built, now)
    return Committed(task, response, events)


# ---------------------------------------------------------------------------------------------
# 11.2: retention, never deleting an unfinished task


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
    cutoff = now - retention_seconds
    terminal = [str(s) for s in TERMINAL_STATES]
    report = PurgeReport()
    with db.write() as session:
        expired = select(col(Task.id)).where(
            col(Task.state).in_(terminal),
            col(Task.finished_at).is_not(None),
            col(Task.finished_at) < cutoff,
        )
        ids = list(session.execute(expired).scalars())
        for chunk in _chunks(ids, 500):
            report.events += _deleted(
                session, delete(TaskEvent).where(col(TaskEvent.task_id).in_(chunk))
            )
            report.responses += _deleted(
                session, delete(Response).where(col(Response.task_id).in_(chunk))
            )
            report.tasks += _deleted(
                session,
                delete(Task).where(col(Task.id).in_(chunk), col(Task.state).in_(terminal)),
            )
        report.idempotency_keys = _deleted(
            session, delete(IdempotencyKey).where(col(IdempotencyKey.expires_at) < now)
        )
    return report


def delete_finished_task(db: Database, task_id: str) -> bool:
    """Delete one finished task with its events and response (a client's explicit delete).
    An unfinished task is left alone and False returned: only finished tasks are deleted."""
    with db.write() as session:
        task = session.get(Task, task_id, with_for_update=True)
        if task is None or TaskState(task.state) not in TERMINAL_STATES:
            return False
        session.execute(delete(TaskEvent).where(col(TaskEvent.task_id) == task_id))
        session.execute(delete(Response).where(col(Response.task_id) == task_id))
        session.delete(task)
    return True


# ---------------------------------------------------------------------------------------------
# 11.2 / 11.3: recovery at start-up


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
    states = _UNFINISHED_NOT_QUEUED if shared_queue else _UNFINISHED
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

    Plain SQL on one DB-API cursor, with the changes written by `executemany`: start-up may
    find ten thousand unfinished tasks, and the ORM's unit of work (one UPDATE per object,
    attribute tracking on every change) would take seconds the service is not yet answering in.
    """
    now = time.time() if now is None else now
    report = RecoveryReport()
    with db.write_cursor() as cursor:
        reason = "unheld"
        if runner_id is not None:
            row = cursor.execute(
                "SELECT * FROM runners WHERE id = ?" + for_update(dialect_of(cursor)), (runner_id,)
            ).fetchone()
            found = runners.gone_reason(_record(row), now) if row is not None else None
            if found is None:
                return report  # alive after all, or already recovered by someone else
            reason = found
        report.runners.append((runner_id, reason))
        holder = "runner_id IS NULL" if runner_id is None else "runner_id = ?"
        held = () if runner_id is None else (runner_id,)
        report.released_claims = cursor.execute(
            "DELETE FROM idempotency_keys WHERE status_code IS NULL AND response_id IS NULL"
            f" AND {holder}",
            held,
        ).rowcount
        examined = tuple(states or _UNFINISHED)
        marks = ", ".join("?" * len(examined))
        rows = cursor.execute(
            f"SELECT * FROM tasks WHERE {holder} AND state IN ({marks}) ORDER BY created_at"
            + for_update(dialect_of(cursor)),
            (*held, *examined),
        ).fetchall()
        _apply_table(cursor, [_record(r) for r in rows], error, now, report, adopter=adopter)
        if runner_id is not None:
            cursor.execute("DELETE FROM runners WHERE id = ?", (runner_id,))
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
    with db.write_cursor() as cursor:
        tasks = _unfinished_tasks(cursor, list(task_ids))
        tasks = [t for t in tasks if not _not_held(t, runner_id)]
        _apply_table(cursor, tasks, WORKER_CRASHED, now, report, adopter=runner_id)
    return report


_UNFINISHED = tuple(str(s) for s in RECOVERY_TABLE)
_UNFINISHED_NOT_QUEUED = tuple(s for s in _UNFINISHED if s != TaskState.QUEUED)


def _anything_unheld(db: Database, states: Sequence[str] = _UNFINISHED) -> bool:
    """Whether some task in `states`, or some claimed idempotency key, has no runner (a cheap
    read, so the periodic sweep takes no write lock when there is nothing to do)."""
    states = ", ".join(f"'{s}'" for s in states)
    with db.read() as session:
        conn = session.connection()
        return (
            conn.exec_driver_sql(
                f"SELECT 1 FROM tasks WHERE runner_id IS NULL AND state IN ({states}) LIMIT 1"
            ).first()
            is not None
            or conn.exec_driver_sql(
                "SELECT 1 FROM idempotency_keys WHERE runner_id IS NULL"
                " AND status_code IS NULL AND response_id IS NULL LIMIT 1"
            ).first()
            is not None
        )


def _apply_table(
    cursor: Cursor,
    tasks: list[Any],
    error: dict[str, str],
    now: float,
    report: RecoveryReport,
    *,
    adopter: str | None,
) -> None:
    """The 11.3 table for `tasks` (unfinished, oldest first), written with three
    `executemany` calls on `cursor`; surviving tasks are given to `adopter`."""
    responses = _responses_of(cursor, [t.response_id for t in tasks if t.response_id])
    event_rows: list[dict[str, Any]] = []
    changed_responses: list[Response] = []
    changed_tasks: list[Any] = []
    for task in tasks:
        report.examined += 1
        found_state = TaskState(task.state)
        target = RECOVERY_TABLE[found_state][RestartPolicy(task.on_restart)]
        key = f"{found_state}->{target}"
        report.transitions[key] = report.transitions.get(key, 0) + 1
        by = (str(found_state), str(task.on_restart), str(target))
        report.by_policy[by] = report.by_policy.get(by, 0) + 1
        response = responses.get(task.response_id) if task.response_id else None
        if target in (TaskState.QUEUED, TaskState.RUNNING):
            report.adopted.append(task.id)
            report.owners[task.id] = task.owner
            if task.runner_id != adopter:
                task.runner_id = adopter
                changed_tasks.append(task)
        if target == found_state:
            continue
        if target in (TaskState.FAILED, TaskState.CANCELLED):
            outcome = Outcome(target, error=dict(error) if target == TaskState.FAILED else None)
            built = _terminate(task, response, outcome, now, _cursor_lookup(cursor, task.id))
            if response is not None:
                changed_responses.append(response)
        else:  # back to queued (loading → queued, or running → queued under `retry`)
            built = _close_open_item(task, "incomplete", _cursor_lookup(cursor, task.id))
            task.state = TaskState.QUEUED
            built.append(
                ev.lifecycle(ev.QUEUED, response_object(response, task))
                if response is not None
                else {"type": "task.queued", "task_id": task.id}
            )
        events = _number(task, built, now, event_rows)
        if not changed_tasks or changed_tasks[-1] is not task:
            changed_tasks.append(task)
        report.committed.append(Committed(task, response, events))
    cursor.executemany(
        "UPDATE tasks SET state = ?, snapshot = ?, error = ?, next_sequence = ?,"
        " updated_at = ?, finished_at = ?, runner_id = ? WHERE id = ?",
        [
            (
                str(t.state),
                t.snapshot,
                t.error,
                t.next_sequence,
                t.updated_at,
                t.finished_at,
                t.runner_id,
                t.id,
            )
            for t in changed_tasks
        ],
    )
    cursor.executemany(
        "UPDATE responses SET output = ?, usage = ?, error = ?, incomplete_reason = ?,"
        " completed_at = ? WHERE id = ?",
        [
            (r.output, r.usage, r.error, r.incomplete_reason, r.completed_at, r.id)
            for r in changed_responses
        ],
    )
    # The events last: should one of them fail (a constraint), the state updates above go
    # back with it, and no task is left in a new state without its event.
    cursor.executemany(
        "INSERT INTO task_events (task_id, sequence_number, type, data, created_at)"
        " VALUES (:task_id, :sequence_number, :type, :data, :created_at)",
        event_rows,
    )


def _unfinished_tasks(cursor: Cursor, task_ids: list[str]) -> list[Any]:
    """Unfinished tasks of `task_ids`, oldest first, as objects outside any session."""
    states = ", ".join("?" * len(_UNFINISHED))
    rows = []
    for chunk in _chunks(task_ids, 500):
        ids = ", ".join("?" * len(chunk))
        rows += cursor.execute(
            f"SELECT * FROM tasks WHERE id IN ({ids}) AND state IN ({states})"
            + for_update(dialect_of(cursor)),
            (*chunk, *_UNFINISHED),
        ).fetchall()
    rows.sort(key=lambda r: r["created_at"])
    return [_record(row) for row in rows]


def _responses_of(cursor: Cursor, response_ids: list[str]) -> dict[str, Response]:
    found: dict[str, Response] = {}
    for chunk in _chunks(response_ids, 500):
        ids = ", ".join("?" * len(chunk))
        for row in cursor.execute(f"SELECT * FROM responses WHERE id IN ({ids})", chunk):
            response = _record(row)
            response.store = bool(response.store)  # SQLite hands booleans back as 0 / 1
            found[response.id] = response
    return found


def _record(row: Any) -> Any:
    """A row as an object with the table model's attributes, for the plain-SQL paths. Not the
    model itself: a SQLModel object (instrumented, validated on every attribute) costs ~60 µs
    to build, more than recovery spends on a task or `append_output` on a transaction."""
    return SimpleNamespace(**dict(row))


# ---------------------------------------------------------------------------------------------
# internals: every write above goes through these


def _not_held(task: Any, runner_id: str | None) -> bool:
    """Whether a runner that asks (`runner_id` given) does not hold `task`."""
    return runner_id is not None and task.runner_id != runner_id


def _load(session: Session, task_id: str) -> tuple[Task, Response | None]:
    """The task (locked until the transaction ends, on PostgreSQL) and its response: a
    response changes only in a transaction that holds its task."""
    task = session.get(Task, task_id, with_for_update=True)
    if task is None:
        raise LMSPError(
            404, "not_found", f"No task with id '{task_id}' found.", type="not_found_error"
        )
    response = session.get(Response, task.response_id) if task.response_id else None
    return task, response


def _append(session: Session, task: Task, events: list[Event], now: float) -> list[Event]:
    """Number `events` from the task's next sequence number and write them with the task."""
    rows: list[dict[str, Any]] = []
    _number(task, events, now, rows)
    session.add(task)
    if rows:
        session.execute(insert(TaskEvent), rows)
    return events


def _number(task: Task, events: list[Event], now: float, rows: list[dict[str, Any]]) -> list[Event]:
    """Give `events` the task's next sequence numbers, adding their rows to `rows`."""
    for event in events:
        event["sequence_number"] = task.next_sequence
        rows.append(
            {
                "task_id": task.id,
                "sequence_number": task.next_sequence,
                "type": event["type"],
                "data": json.dumps(event, separators=(",", ":")),
                "created_at": now,
            }
        )
        task.next_sequence += 1
    task.updated_at = now
    return events


def _close_open_item(task: Task, status: str, lookup: LogprobLookup | None = None) -> list[Event]:
    """The done events of the items still open, marking the attempt closed in the snapshot."""
    attempt = Attempt.load(task.snapshot)
    if not attempt.open:
        return []
    events = attempt.close(status, lookup)
    task.snapshot = attempt.dump()
    return events


_TERMINAL_EVENT = {
    TaskState.COMPLETED: ev.COMPLETED,
    TaskState.FAILED: ev.FAILED,
    TaskState.CANCELLED: ev.CANCELLED,
}


def _terminate(
    task: Task,
    response: Response | None,
    outcome: Outcome,
    now: float,
    lookup: LogprobLookup | None = None,
) -> list[Event]:
    """Move a task (and its response) to its terminal state; the events that say so, ending
    with exactly one terminal event, for the caller to number and write."""
    incomplete = outcome.state == TaskState.COMPLETED and outcome.incomplete_reason is not None
    item_status = (
        "completed" if outcome.state == TaskState.COMPLETED and not incomplete else "incomplete"
    )
    was_open = Attempt.load(task.snapshot).open
    events = _close_open_item(task, item_status, lookup)
    task.state = outcome.state
    task.finished_at = now
    task.runner_id = None  # a finished task is nobody's to drive
    if outcome.error is not None:
        task.error = json.dumps(outcome.error)
    if response is not None:
        if was_open:
            response.output = json.dumps(Attempt.load(task.snapshot).output(lookup))
        if outcome.usage is not None:
            response.usage = json.dumps(outcome.usage)
        if outcome.error is not None:
            response.error = json.dumps(outcome.error)
        response.incomplete_reason = outcome.incomplete_reason if incomplete else None
        response.completed_at = now
        kind = ev.INCOMPLETE if incomplete else _TERMINAL_EVENT[outcome.state]
        events.append(ev.lifecycle(kind, response_object(response, task)))
    else:
        events.append(
            {
                "type": f"task.{outcome.state}",
                "task_id": task.id,
                "error": outcome.error,
                "result": outcome.result,
            }
        )
    return events


def _insert(cursor: Cursor, table: str, values: dict[str, Any], tail: str = "") -> None:
    columns = ", ".join(values)
    marks = ", ".join(f":{k}" for k in values)
    cursor.execute(f"INSERT INTO {table} ({columns}) VALUES ({marks}){tail}", values)


def _deleted(session: Session, statement: Delete) -> int:
    """Run a DELETE; how many rows it removed (a DML statement's result is a cursor result)."""
    return cast(CursorResult[Any], session.execute(statement)).rowcount


def _chunks(items: list[Any], size: int) -> list[list[Any]]:
    return [items[i : i + size] for i in range(0, len(items), size)]
