"""What a caller's unfinished tasks hold, counted inside the transaction that creates a new
one (`rules.create_task`'s `admit`), for admission's quota (`services.admission`).

On PostgreSQL writers run side by side, so the count first takes the advisory lock
`quota:<owner>`: the creates of one owner take turns, and two cannot both count the same
tasks and overshoot together. On SQLite the write transaction excludes every other writer
already.
"""

from __future__ import annotations

from sqlalchemy import BigInteger, bindparam, cast, func, select
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Connection

__all__ = ["UNFINISHED", "Connection", "held"]

from ..protocol.states import RECOVERY_TABLE
from .records import advisory_lock, table
from .tables import Task

UNFINISHED = tuple(str(s) for s in RECOVERY_TABLE)

_tasks = table(Task)


def _held(budget: object) -> object:
    """Unfinished tasks of `:owner`, and the sum of their `params.budget` (0 when none)."""
    return select(func.count(), cast(func.coalesce(func.sum(budget), 0), BigInteger)).where(
        _tasks.c.owner == bindparam("owner"), _tasks.c.state.in_(UNFINISHED)
    )


# The budget each task holds, as the admission that accepted it wrote it into its params.
_HELD = {
    "sqlite": _held(func.json_extract(_tasks.c.params, "$.budget")),
    "postgresql": _held(cast(cast(_tasks.c.params, postgresql.JSON)["budget"].astext, BigInteger)),
}


def held(conn: Connection, owner: str) -> tuple[int, int]:
    """How many unfinished tasks `owner` has, and how many tokens they hold, as committed: in
    the caller's write transaction, after taking the owner's quota lock (PostgreSQL)."""
    advisory_lock(conn, f"quota:{owner}")
    row = conn.execute(_HELD[conn.dialect.name], {"owner": owner}).one()  # type: ignore[call-overload]
    return int(row[0]), int(row[1])
