"""Read-only look-ups: tasks, responses, events, and the service's identity.

Each function opens one read transaction (`Database.reading`, Core statements on its
connection; `service_identity` may write once) and returns table models or plain values.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import bindparam, func, select

from ..protocol.states import TaskState
from .database import Database
from .dialect import POSTGRESQL, SQLITE, insert_of
from .records import get, records, table
from .tables import Response, ServiceConfig, Task, TaskEvent

_tasks = table(Task)
_events = table(TaskEvent)
_config = table(ServiceConfig)
_responses = table(Response)
_EVENTS = (
    select(_events.c.data)
    .where(
        _events.c.task_id == bindparam("task_id"), _events.c.sequence_number > bindparam("after")
    )
    .order_by(_events.c.sequence_number)
)
_TO_RUN = (
    select(_tasks)
    .where(
        _tasks.c.state.in_([TaskState.QUEUED, TaskState.RUNNING, TaskState.LOADING]),
        _tasks.c.kind == bindparam("kind"),
    )
    .order_by(_tasks.c.created_at)
)
_BY_STATE = select(_tasks.c.state, func.count()).group_by(_tasks.c.state)
_LAST_EVENT = select(func.max(_events.c.id))
_LIFECYCLE = (
    select(
        _events.c.id,
        _events.c.task_id,
        _events.c.sequence_number,
        _events.c.type,
        _events.c.created_at,
        _tasks.c.owner,
        _tasks.c.kind,
        _tasks.c.model,
        _tasks.c.response_id,
    )
    .join_from(_events, _tasks, _tasks.c.id == _events.c.task_id)
    .where(
        _events.c.id > bindparam("after"),
        _events.c.id <= bindparam("top"),
        _events.c.type.in_(bindparam("types", expanding=True)),
    )
    .order_by(_events.c.id)
    .limit(bindparam("limit"))
)


@dataclass
class TaskPage:
    tasks: list[Task]
    has_more: bool


def get_task(db: Database, task_id: str) -> Task | None:
    with db.reading() as conn:
        return get(conn, Task, task_id)


def get_response(db: Database, response_id: str) -> tuple[Response, Task] | None:
    with db.reading() as conn:
        response = get(conn, Response, response_id)
        if response is None:
            return None
        task = get(conn, Task, response.task_id)
        if task is None:
            return None
        return response, task


def get_task_and_response(db: Database, task_id: str) -> tuple[Task, Response | None] | None:
    with db.reading() as conn:
        task = get(conn, Task, task_id)
        if task is None:
            return None
        response = get(conn, Response, task.response_id) if task.response_id else None
        return task, response


def list_tasks(
    db: Database,
    *,
    states: list[str] | None = None,
    kind: str | None = None,
    owners: list[str] | None = None,
    after: str | None = None,
    limit: int = 20,
) -> TaskPage:
    """Tasks newest first (of `owners`, when given); `after` is the id of the last task of
    the previous page."""
    query = select(_tasks)
    if states:
        query = query.where(_tasks.c.state.in_(states))
    if kind:
        query = query.where(_tasks.c.kind == kind)
    if owners is not None:
        query = query.where(_tasks.c.owner.in_(owners))
    with db.reading() as conn:
        if after:
            anchor = get(conn, Task, after)
            if anchor is not None:
                query = query.where(
                    (_tasks.c.created_at < anchor.created_at)
                    | ((_tasks.c.created_at == anchor.created_at) & (_tasks.c.id < anchor.id))
                )
        query = query.order_by(_tasks.c.created_at.desc(), _tasks.c.id.desc()).limit(limit + 1)
        rows = records(Task, conn.execute(query))
        return TaskPage(rows[:limit], len(rows) > limit)


@dataclass(frozen=True)
class ResponseSummary:
    """What a task list shows of a task's response (`protocol.objects.task_object`)."""

    id: str
    request: str
    usage: str | None
    incomplete_reason: str | None


_SUMMARIES = select(
    _responses.c.id, _responses.c.request, _responses.c.usage, _responses.c.incomplete_reason
).where(_responses.c.id.in_(bindparam("ids", expanding=True)))


def response_summaries(db: Database, response_ids: list[str]) -> dict[str, ResponseSummary]:
    """The summaries of the responses of these ids (those that exist), by id: only the columns
    a task list reads, never a response's output (the write rules' full rows are
    `rules.rows.responses_of`)."""
    if not response_ids:
        return {}
    with db.reading() as conn:
        rows = conn.execute(_SUMMARIES, {"ids": response_ids})
        return {r.id: ResponseSummary(**r._mapping) for r in rows}


def list_events(
    db: Database, task_id: str, after: int = -1, limit: int | None = None
) -> list[dict]:
    """The task's committed events with `sequence_number > after`, in order."""
    query = _EVENTS if limit is None else _EVENTS.limit(limit)
    with db.reading() as conn:
        found = conn.execute(query, {"task_id": task_id, "after": after}).scalars()
        return [json.loads(data) for data in found]


def tasks_to_run(db: Database, kind: str = "response", runner_id: str | None = None) -> list[Task]:
    """Unfinished tasks of `kind` to pick up, oldest first: those `runner_id` holds (after
    start-up recovery, or a recovery that adopted them), or every one when None."""
    query = _TO_RUN if runner_id is None else _TO_RUN.where(_tasks.c.runner_id == runner_id)
    with db.reading() as conn:
        return records(Task, conn.execute(query, {"kind": kind}))


def service_identity(db: Database) -> str:
    """The service id: made once, stored in `service_config`, the same after every restart."""
    return str(_config_made_once(db, "service_id", lambda: f"svc_{secrets.token_hex(16)}"))


def sealing_key(db: Database) -> bytes:
    """The key the service seals the items clients carry for it with (`services.sealing`):
    256 random bits, made once and kept in `service_config`, so every server on the database
    and every restart opens what another sealed."""
    return bytes.fromhex(_config_made_once(db, "sealing_key", lambda: secrets.token_hex(32)))


def _config_made_once(db: Database, key: str, make: Callable[[], str]) -> str:
    """The `service_config` value of `key`, made by `make` and stored the first time."""
    with db.reading() as conn:
        row = get(conn, ServiceConfig, key)
        if row is not None:
            return str(json.loads(row.value))
    made = json.dumps(make())
    insert = insert_of(POSTGRESQL if db.is_postgres else SQLITE)
    with db.writing() as conn:
        # Two servers starting together on a new database: the first insert wins, and both
        # read back the one stored.
        conn.execute(
            insert(_config)
            .values(key=key, value=made)
            .on_conflict_do_nothing(index_elements=["key"])
        )
        row = get(conn, ServiceConfig, key)
        assert row is not None
        return str(json.loads(row.value))


TASK_STATES: tuple[str, ...] = tuple(str(s) for s in TaskState)


def count_tasks_by_state(db: Database) -> dict[str, int]:
    """How many tasks the database holds in each state (every server's)."""
    with db.reading() as conn:
        return {str(state): int(n) for state, n in conn.execute(_BY_STATE)}


@dataclass
class LifecycleRow:
    """A lifecycle event of some task, with what the caller-wide stream tells of its task."""

    id: int
    task_id: str
    sequence_number: int
    type: str
    created_at: float
    owner: str
    kind: str
    model: str | None
    response_id: str | None


def last_event_id(db: Database) -> int:
    """The row id of the newest event (every task's), -1 when there is none."""
    with db.reading() as conn:
        found = conn.execute(_LAST_EVENT).scalar()
        return -1 if found is None else int(found)


def lifecycle_events(
    db: Database, after: int, types: tuple[str, ...], limit: int = 500
) -> tuple[list[LifecycleRow], int]:
    """Events of these `types` (every task's) with a row id above `after`, oldest first, and
    the row id the read covered: the last event's when `limit` rows came, else the newest
    event's (the next read starts there, not again over the text events in between). Row ids
    follow commit order (one writer at a time), so no event appears later below it."""
    with db.reading() as conn:
        top = conn.execute(_LAST_EVENT).scalar()
        if top is None or top <= after:
            return [], after
        found = conn.execute(
            _LIFECYCLE, {"after": after, "top": top, "types": list(types), "limit": limit}
        )
        rows = [LifecycleRow(*row) for row in found]
        return rows, rows[-1].id if len(rows) == limit else int(top)
