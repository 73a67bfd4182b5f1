"""What a caller's unfinished tasks hold, counted inside the transaction that creates a new
one (`rules.create_task`'s `admit`), for admission's quota (`services.admission`).

A quota is shared by an approval tree (issue 43): a paired client with `clients:admin` may
approve sub-clients, and they may approve more; their unfinished tasks all count against one
quota, that of the client at the tree's root (the one a Jupyter user approved), so pairing
sub-clients never multiplies what a client may hold. A caller that is no paired client (no
row in `clients`) is a tree of its own.

A tree's stored output counts too (issue 43): the characters of the events and response
output of its finished tasks (JSON, so bytes for its ASCII text; registrations and other tasks
without a response count their events). A finished task's are counted once, into its
`stored_bytes`, the first time a check needs them (its events and output never change again),
so a check reads the tasks of the tree, not their events. Deleting responses, or their expiry by
the retention purge, deletes their tasks and frees it.

On PostgreSQL writers run side by side, so the count first takes the advisory lock
`quota:<root>`: the creates of one tree take turns, and two cannot both count the same
tasks and overshoot together. On SQLite the write transaction excludes every other writer
already.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from dataclasses import dataclass

from sqlalchemy import BigInteger, bindparam, cast, func, select, update
from sqlalchemy.engine import Connection

__all__ = ["UNFINISHED", "Connection", "Usage", "approval_tree", "usage"]

from ..protocol.states import RECOVERY_TABLE, TERMINAL_STATES
from . import dialect
from .records import advisory_lock, table
from .tables import Client, Response, Task, TaskEvent

UNFINISHED = tuple(str(s) for s in RECOVERY_TABLE)
FINISHED = tuple(sorted(str(s) for s in TERMINAL_STATES))

_tasks = table(Task)
_clients = table(Client)
_events = table(TaskEvent)
_responses = table(Response)
_FINISHED_OF_TREE = (
    _tasks.c.owner.in_(bindparam("owners", expanding=True)),
    _tasks.c.state.in_(FINISHED),
)
# Counts what the tree's finished tasks not yet counted keep (each task once: see above).
_COUNT_STORED = (
    update(_tasks)
    .where(*_FINISHED_OF_TREE, _tasks.c.stored_bytes.is_(None))
    .values(
        stored_bytes=select(func.coalesce(func.sum(func.length(_events.c.data)), 0))
        .where(_events.c.task_id == _tasks.c.id)
        .scalar_subquery()
        + select(func.coalesce(func.sum(func.length(_responses.c.output)), 0))
        .where(_responses.c.task_id == _tasks.c.id)
        .scalar_subquery()
    )
)
_STORED = select(cast(func.coalesce(func.sum(_tasks.c.stored_bytes), 0), BigInteger)).where(
    *_FINISHED_OF_TREE
)
# Every paired client and who approved it: a few rows (clients are paired by hand).
_APPROVERS = select(_clients.c.id, _clients.c.approved_by)


def _held(budget: object) -> object:
    """Unfinished tasks of `:owners`, and the sum of their `params.budget` (0 when none)."""
    return select(func.count(), cast(func.coalesce(func.sum(budget), 0), BigInteger)).where(
        _tasks.c.owner.in_(bindparam("owners", expanding=True)), _tasks.c.state.in_(UNFINISHED)
    )


@functools.cache
def _held_in(name: str) -> object:
    """The budget each task holds, as the admission that accepted it wrote it into its params
    (in the dialect `name`'s JSON)."""
    if name == dialect.POSTGRESQL:
        return _held(
            cast(cast(_tasks.c.params, dialect.json_type(name))["budget"].astext, BigInteger)
        )
    return _held(func.json_extract(_tasks.c.params, "$.budget"))


def approval_tree(conn: Connection, client_id: str) -> tuple[str, list[str]]:
    """The root of `client_id`'s approval tree (the client a Jupyter user approved; itself
    when no paired client approved it) and every client of the tree, the root first."""
    approver = {str(c): a for c, a in conn.execute(_APPROVERS).all()}
    root, seen = client_id, {client_id}
    while (up := approver.get(root)) in approver and up not in seen:
        root = up
        seen.add(root)
    children: defaultdict[str, list[str]] = defaultdict(list)
    for child, parent in approver.items():
        if parent is not None:
            children[parent].append(child)
    tree, members = [root], {root}
    for node in tree:
        for child in children[node]:
            if child not in members:
                members.add(child)
                tree.append(child)
    return root, tree


@dataclass(frozen=True)
class Usage:
    """What an approval tree holds: unfinished tasks, the tokens they hold, and (when asked
    for) the characters its finished tasks keep."""

    tasks: int
    tokens: int
    stored: int | None = None

    @property
    def held(self) -> tuple[int, int]:
        return self.tasks, self.tokens


def usage(conn: Connection, owner: str, stored: bool = False) -> Usage:
    """What `owner`'s approval tree holds, as committed: in the caller's write transaction,
    after taking the tree's quota lock (PostgreSQL). With `stored`, also what its finished
    tasks keep (counting those finished since the last check)."""
    root, tree = approval_tree(conn, owner)
    advisory_lock(conn, f"quota:{root}")
    row = conn.execute(_held_in(conn.dialect.name), {"owners": tree}).one()  # type: ignore[call-overload]
    kept = None
    if stored:
        conn.execute(_COUNT_STORED, {"owners": tree})
        kept = int(conn.execute(_STORED, {"owners": tree}).scalar_one())
    return Usage(int(row[0]), int(row[1]), kept)
