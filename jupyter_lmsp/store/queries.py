"""Read-only look-ups: tasks, responses, events, and the service's identity.

Each function opens one read transaction and returns detached rows or plain values.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass

from sqlalchemy import select
from sqlmodel import col

from ..protocol.states import TaskState
from .database import Database
from .tables import Response, ServiceConfig, Task, TaskEvent


@dataclass
class TaskPage:
    tasks: list[Task]
    has_more: bool


def get_task(db: Database, task_id: str) -> Task | None:
    with db.read() as session:
        return session.get(Task, task_id)


def get_response(db: Database, response_id: str) -> tuple[Response, Task] | None:
    with db.read() as session:
        response = session.get(Response, response_id)
        if response is None:
            return None
        task = session.get(Task, response.task_id)
        if task is None:
            return None
        return response, task


def get_task_and_response(db: Database, task_id: str) -> tuple[Task, Response | None] | None:
    with db.read() as session:
        task = session.get(Task, task_id)
        if task is None:
            return None
        response = session.get(Response, task.response_id) if task.response_id else None
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
    with db.read() as session:
        query = select(Task)
        if states:
            query = query.where(col(Task.state).in_(states))
        if kind:
            query = query.where(col(Task.kind) == kind)
        if owners is not None:
            query = query.where(col(Task.owner).in_(owners))
        if after:
            anchor = session.get(Task, after)
            if anchor is not None:
                query = query.where(
                    (col(Task.created_at) < anchor.created_at)
                    | ((col(Task.created_at) == anchor.created_at) & (col(Task.id) < anchor.id))
                )
        query = query.order_by(col(Task.created_at).desc(), col(Task.id).desc()).limit(limit + 1)
        rows = list(session.execute(query).scalars())
        return TaskPage(rows[:limit], len(rows) > limit)


def list_events(
    db: Database, task_id: str, after: int = -1, limit: int | None = None
) -> list[dict]:
    """The task's committed events with `sequence_number > after`, in order."""
    with db.read() as session:
        query = (
            select(col(TaskEvent.data))
            .where(col(TaskEvent.task_id) == task_id, col(TaskEvent.sequence_number) > after)
            .order_by(col(TaskEvent.sequence_number))
        )
        if limit is not None:
            query = query.limit(limit)
        return [json.loads(data) for data in session.execute(query).scalars()]


def tasks_to_run(db: Database, kind: str = "response", runner_id: str | None = None) -> list[Task]:
    """Unfinished tasks of `kind` to pick up, oldest first: those `runner_id` holds (after
    start-up recovery, or a recovery that adopted them), or every one when None."""
    with db.read() as session:
        query = (
            select(Task)
            .where(
                col(Task.state).in_([TaskState.QUEUED, TaskState.RUNNING, TaskState.LOADING]),
                col(Task.kind) == kind,
            )
            .order_by(col(Task.created_at))
        )
        if runner_id is not None:
            query = query.where(Task.runner_id == runner_id)  # type: ignore[arg-type]
        return list(session.execute(query).scalars())


def service_identity(db: Database) -> str:
    """The service id: made once, stored in `service_config`, the same after every restart."""
    with db.read() as session:
        row = session.get(ServiceConfig, "service_id")
        if row is not None:
            return json.loads(row.value)
    with db.write() as session:
        row = session.get(ServiceConfig, "service_id")
        if row is None:
            row = ServiceConfig(key="service_id", value=json.dumps(f"svc_{secrets.token_hex(16)}"))
            session.add(row)
        return json.loads(row.value)


TASK_STATES: tuple[str, ...] = tuple(str(s) for s in TaskState)


def count_tasks_by_state(db: Database) -> dict[str, int]:
    """How many tasks the database holds in each state (every server's)."""
    with db.read() as session:
        rows = session.connection().exec_driver_sql(
            "SELECT state, COUNT(*) FROM tasks GROUP BY state"
        )
        return {str(state): int(n) for state, n in rows}


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
    with db.read() as session:
        found = session.connection().exec_driver_sql("SELECT MAX(id) FROM task_events").scalar()
        return -1 if found is None else int(found)


def lifecycle_events(
    db: Database, after: int, types: tuple[str, ...], limit: int = 500
) -> tuple[list[LifecycleRow], int]:
    """Events of these `types` (every task's) with a row id above `after`, oldest first, and
    the row id the read covered: the last event's when `limit` rows came, else the newest
    event's (the next read starts there, not again over the text events in between). Row ids
    follow commit order (one writer at a time), so no event appears later below it."""
    marks = ", ".join("?" * len(types))
    with db.read() as session:
        conn = session.connection()
        top = conn.exec_driver_sql("SELECT MAX(id) FROM task_events").scalar()
        if top is None or top <= after:
            return [], after
        rows = [
            LifecycleRow(*row)
            for row in conn.exec_driver_sql(
                "SELECT e.id, e.task_id, e.sequence_number, e.type, e.created_at, t.owner,"
                " t.kind, t.model, t.response_id FROM task_events e JOIN tasks t"
                f" ON t.id = e.task_id WHERE e.id > ? AND e.id <= ? AND e.type IN ({marks})"
                " ORDER BY e.id LIMIT ?",
                (after, top, *types, limit),
            )
        ]
        return rows, rows[-1].id if len(rows) == limit else int(top)
