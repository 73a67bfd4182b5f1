"""Following a task's event log: stored events after a sequence number, then live ones.

The subscription is opened before the replay query, so an event committed between the two is
in the queue; anything at or below the last sequence number already yielded is dropped. The
result is every event after `after`, exactly once, in order, with no gap, until the terminal
event. Both reads of the log (the replay, and a gap's fill) run through `offload`, on a database
thread: the IOLoop never waits on the database. Whichever server drives the task: events another server commits reach this server's
bus through `services.feed`, from the end of the replay on.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncGenerator
from typing import Any

from ..protocol.events import is_terminal
from ..store import queries
from ..store.database import Database
from . import metrics
from .bus import CLOSED, EventBus, Subscription
from .lifecycle import Offload

Event = dict[str, Any]


class TaskEventStream:
    """An async iterator over a task's events after `after`: None after `idle` seconds without
    one (the caller writes a keep-alive), and the end after the terminal event.

    `ready` says whether the next event is already at hand, so a writer can send several in
    one flush (the four or five events of a task's end arrive together).

    `caller` names the paired client the stream serves: the stream ends early, without its
    terminal event, when that client is revoked (`EventBus.close_caller`)."""

    def __init__(
        self,
        db: Database,
        bus: EventBus,
        task_id: str,
        after: int = -1,
        idle: float = 15.0,
        caller: str | None = None,
        *,
        offload: Offload,
    ) -> None:
        self.db, self.bus, self.task_id, self.after, self.idle = db, bus, task_id, after, idle
        self.offload = offload
        self.caller = caller
        # Set when the stream ended because its caller was revoked (no terminal event came).
        self.revoked = False
        self._replay: deque[Event] = deque()
        self._sub: Subscription | None = None
        self._events = self._follow()

    @property
    def ready(self) -> bool:
        return bool(self._replay) or (self._sub is not None and not self._sub.queue.empty())

    def __aiter__(self) -> TaskEventStream:
        return self

    async def __anext__(self) -> Event | None:
        return await self._events.__anext__()

    async def aclose(self) -> None:
        await self._events.aclose()

    async def _follow(self) -> AsyncGenerator[Event | None, None]:
        with self.bus.subscribe(self.task_id, self.caller) as sub:
            self._sub = sub
            last = self.after
            self._replay.extend(
                await self.offload(queries.list_events, self.db, self.task_id, last)
            )
            metrics.events_replayed(len(self._replay))
            # What the replay holds is read: the feed (events other servers commit) goes on
            # from there.
            sub.seen(self._replay[-1]["sequence_number"] if self._replay else last)
            while self._replay:
                event = self._replay.popleft()
                last = event["sequence_number"]
                yield event
                if is_terminal(event):
                    return
            while True:
                item = await sub.get(timeout=self.idle)
                if item is None:
                    yield None
                    continue
                _, event = item
                if event is CLOSED:
                    self.revoked = True
                    return
                seq = event["sequence_number"]
                if seq <= last:
                    continue
                if seq > last + 1:
                    # Published events are contiguous, so a gap means this watcher fell behind
                    # a replay boundary; the database has the missing ones.
                    missed = await self.offload(queries.list_events, self.db, self.task_id, last)
                    for missing in missed:
                        if missing["sequence_number"] >= seq:
                            break
                        last = missing["sequence_number"]
                        metrics.events_replayed(1)
                        yield missing
                last = seq
                yield event
                if is_terminal(event):
                    return
