"""The caller-wide lifecycle stream: every task of the caller created, changing state, ending
(`GET /lifecycle`), so a board of tasks follows one stream instead of polling `/tasks`.

The database is the source: the stream reads the lifecycle events (`protocol.tasks.
LIFECYCLE_STATES`) of every task after its cursor, the events' row id, which orders all tasks'
events together and is each frame's SSE `id` (a reconnect with `Last-Event-ID` misses nothing
and repeats nothing). It reads again whenever a lifecycle event is published on this server's
bus, and every `poll` seconds for what other servers on the database commit. The caller sees
the tasks it may see (`Caller.can_see`); a revoked client's stream ends at once.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

from ..auth.scopes import Caller
from ..protocol.tasks import LIFECYCLE_STATES, LifecycleEvent
from ..store import queries
from ..store.database import Database
from . import metrics
from .bus import ALL_TASKS, CLOSED, EventBus, Subscription

Offload = Callable[..., Awaitable[Any]]

TYPES = tuple(LIFECYCLE_STATES)
# Rows read at once: a long replay is sent in pages.
PAGE = 500


class LifecycleStream:
    """An async iterator over the caller's task transitions after `after` (None: from now):
    event dicts, or None after `idle` seconds without one (the writer sends a keep-alive)."""

    def __init__(
        self,
        db: Database,
        bus: EventBus,
        caller: Caller,
        offload: Offload,
        after: int | None,
        *,
        idle: float = 15.0,
        poll: float = 1.0,
    ) -> None:
        self.db, self.bus, self.caller, self.offload = db, bus, caller, offload
        self.after, self.idle, self.poll = after, idle, poll
        self._ready: deque[dict[str, Any]] = deque()
        self._sub: Subscription | None = None
        self._replay = False
        self._events = self._follow()

    @property
    def ready(self) -> bool:
        return bool(self._ready)

    def __aiter__(self) -> LifecycleStream:
        return self

    async def __anext__(self) -> dict[str, Any] | None:
        return await self._events.__anext__()

    async def aclose(self) -> None:
        await self._events.aclose()
        if self._sub is not None:
            self._sub.close()  # also when the stream ended before its first read

    async def start(self) -> None:
        """Subscribe and fix the starting point before the stream's answer begins: a client
        that lists `/tasks` once the answer's headers arrived misses no transition between
        the two."""
        self._sub = self.bus.subscribe(ALL_TASKS, self.caller.id)
        self._replay = self.after is not None
        if self.after is None:
            self.after = await self.offload(queries.last_event_id, self.db)

    async def _follow(self) -> AsyncGenerator[dict[str, Any] | None, None]:
        if self._sub is None:
            await self.start()
        assert self._sub is not None and self.after is not None
        # Subscribed before the first read: nothing committed in between is missed.
        with self._sub as sub:
            cursor = self.after
            replay = self._replay
            quiet = 0.0
            while True:
                rows, cursor = await self.offload(
                    queries.lifecycle_events, self.db, cursor, TYPES, PAGE
                )
                for row in rows:
                    if self.caller.can_see(row.owner):
                        self._ready.append(_event(row))
                if replay:
                    metrics.events_replayed(len(self._ready))
                    replay = len(rows) == PAGE
                while self._ready:
                    quiet = 0.0
                    yield self._ready.popleft()
                if len(rows) == PAGE:
                    continue
                woke = await _lifecycle_published(sub, self.poll)
                if woke is CLOSED:
                    return  # the caller was revoked
                if woke is None:
                    quiet += self.poll
                    if quiet >= self.idle:
                        quiet = 0.0
                        yield None


async def _lifecycle_published(sub: Subscription, timeout: float) -> object:
    """Wait up to `timeout` for a lifecycle event on the bus: True when one came, CLOSED when
    the caller lost access, None when the time passed (other events are drained unread)."""
    loop_time = asyncio.get_running_loop().time
    deadline = loop_time() + timeout
    remaining = timeout
    while remaining > 0:
        item = await sub.get(timeout=remaining)
        if item is None:
            return None
        _, event = item
        if event is CLOSED:
            return CLOSED
        if event.get("type") in LIFECYCLE_STATES:
            # Take whatever else is already queued: one read covers them all.
            while not sub.queue.empty():
                _, more = sub.queue.get_nowait()
                if more is CLOSED:
                    return CLOSED
            return True
        remaining = deadline - loop_time()
    return None


def _event(row: queries.LifecycleRow) -> dict[str, Any]:
    return LifecycleEvent(
        type=row.type,
        sequence_number=row.id,
        task_id=row.task_id,
        task_sequence_number=row.sequence_number,
        state=LIFECYCLE_STATES[row.type],
        kind=row.kind,
        model=row.model,
        response_id=row.response_id,
        created_at=row.created_at,
    ).wire()
