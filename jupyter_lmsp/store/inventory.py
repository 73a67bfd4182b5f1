"""What a database holds, counted for `jupyter lmsp doctor`: the unfinished tasks and who
holds them, and how many rows each table has. Read only, each function one read transaction.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import bindparam, func, select

from .database import Database
from .quotas import UNFINISHED
from .records import table
from .tables import Client, Model, Response, Task, TaskEvent

_tasks = table(Task)
_unfinished = _tasks.c.state.in_(UNFINISHED)
_BY_HOLDER = (
    select(_tasks.c.runner_id, _tasks.c.state, func.count())
    .where(_unfinished)
    .group_by(_tasks.c.runner_id, _tasks.c.state)
)
_OLDEST = (
    select(
        _tasks.c.id,
        _tasks.c.kind,
        _tasks.c.state,
        _tasks.c.on_restart,
        _tasks.c.owner,
        _tasks.c.runner_id,
        _tasks.c.created_at,
    )
    .where(_unfinished)
    .order_by(_tasks.c.created_at)
    .limit(bindparam("limit"))
)
_COUNT_UNFINISHED = select(func.count()).select_from(_tasks).where(_unfinished)
# The tables whose sizes the doctor shows, in its order.
_COUNTED = {
    t.name: select(func.count()).select_from(t)
    for t in (table(Task), table(TaskEvent), table(Response), table(Model), table(Client))
}


@dataclass
class UnfinishedTask:
    id: str
    kind: str
    state: str
    on_restart: str
    owner: str
    runner_id: str | None
    created_at: float


def unfinished_by_holder(db: Database) -> list[tuple[str | None, str, int]]:
    """(runner id or None, state, how many) for every unfinished task."""
    with db.reading() as conn:
        return [(holder, str(state), int(n)) for holder, state, n in conn.execute(_BY_HOLDER)]


def unfinished_tasks(db: Database, limit: int) -> tuple[list[UnfinishedTask], int]:
    """The `limit` oldest unfinished tasks, and how many there are in all."""
    with db.reading() as conn:
        rows = [UnfinishedTask(*row) for row in conn.execute(_OLDEST, {"limit": limit})]
        return rows, int(conn.execute(_COUNT_UNFINISHED).scalar() or 0)


def row_counts(db: Database) -> dict[str, int]:
    """How many rows each of the main tables holds."""
    with db.reading() as conn:
        return {name: int(conn.execute(q).scalar() or 0) for name, q in _COUNTED.items()}
