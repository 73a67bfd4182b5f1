"""Fan-out of committed events to whoever watches a task here (SSE streams, widgets).

Events reach the bus after the transaction that wrote them committed, on the IOLoop thread:
from this server's own runner and services right after their commits, and from
`services.feed`, which reads the events other servers on the same database committed. The
same event can come both ways (a task this server watches changes hands), so the bus keeps,
for each watched task, the highest sequence number it delivered and drops anything at or
below it. Watchers that need every event (`services.follow`) fill a gap from the database.

`publish` and `close_caller` may be called from any thread once the bus is bound to its loop
(`bind`): from another thread they hand their work to the loop. `watched()` tells the feed
which tasks to read and from where, from the feed's thread.

A subscription may name the caller it serves; `close_caller` then ends every such subscription
(a revoked client's streams close at once): its queue receives `CLOSED`.
"""

from __future__ import annotations

import asyncio
import threading
from collections import defaultdict
from collections.abc import Callable
from typing import Any

Event = dict[str, Any]

ALL_TASKS = "*"
# Put in a subscription's queue when its caller lost access: the subscriber stops.
CLOSED: Event = {"type": "lmsp.closed"}


class Subscription:
    def __init__(self, bus: EventBus, task_id: str, caller: str | None = None) -> None:
        self.bus = bus
        self.task_id = task_id
        self.caller = caller
        self.queue: asyncio.Queue[tuple[str, Event]] = asyncio.Queue()

    async def get(self, timeout: float | None = None) -> tuple[str, Event] | None:
        """The next (task_id, event), or None when `timeout` passes first."""
        # Events usually wait in the queue already (one publish wakes every watcher): take them
        # without the timer machinery, which costs more than the event itself with 200 readers.
        if not self.queue.empty():
            return self.queue.get_nowait()
        try:
            async with asyncio.timeout(timeout):
                return await self.queue.get()
        except TimeoutError:
            return None

    def seen(self, sequence_number: int) -> None:
        """The watcher has read the task's log up to `sequence_number` from the database.
        If it is the task's first watcher, later events are the ones to deliver (the feed
        reads from there); otherwise nothing changes (`EventBus.seen`)."""
        self.bus.seen(self.task_id, sequence_number)

    def close(self) -> None:
        self.bus.unsubscribe(self)

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class EventBus:
    def __init__(self) -> None:
        self._subscribers: dict[str, set[Subscription]] = defaultdict(set)
        # For each watched task: the highest sequence number published to its watchers (or,
        # before anything was, the end of its first watcher's replay), None until one is.
        self._delivered: dict[str, int | None] = {}
        self._lock = threading.Lock()
        self.loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        # Called (on the caller's thread) when a task becomes watched: the feed
        # (`services.feed`) looks at the database often only while something is.
        self.on_watch: Callable[[], None] | None = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """The loop the watchers live on (called from it)."""
        self.loop = loop
        self._loop_thread = threading.current_thread()

    def subscribe(self, task_id: str = ALL_TASKS, caller: str | None = None) -> Subscription:
        sub = Subscription(self, task_id, caller)
        with self._lock:
            self._subscribers[task_id].add(sub)
            if task_id != ALL_TASKS:
                self._delivered.setdefault(task_id, None)
        return sub

    def close_caller(self, caller: str) -> int:
        """End every subscription held for `caller`; how many there were."""
        with self._lock:
            subs = [sub for group in self._subscribers.values() for sub in group]
        closing = [sub for sub in subs if sub.caller == caller]
        for sub in closing:
            if self._off_loop():
                assert self.loop is not None
                self.loop.call_soon_threadsafe(sub.queue.put_nowait, (sub.task_id, CLOSED))
            else:
                sub.queue.put_nowait((sub.task_id, CLOSED))
        return len(closing)

    def _off_loop(self) -> bool:
        return (
            self.loop is not None
            and self._loop_thread is not None
            and threading.current_thread() is not self._loop_thread
        )

    def unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            subs = self._subscribers.get(sub.task_id)
            if subs is not None:
                subs.discard(sub)
                if not subs:
                    del self._subscribers[sub.task_id]
                    self._delivered.pop(sub.task_id, None)

    def seen(self, task_id: str, sequence_number: int) -> None:
        # Only the first watcher's replay sets where delivery starts. A later watcher whose
        # replay read further must not move it on: the watchers already here have had only
        # what was published, and the events between that and the newcomer's replay would
        # reach none of them (with nothing after them, e.g. a task that ended meanwhile, they
        # would wait forever). The newcomer drops what it replayed already.
        with self._lock:
            first = task_id in self._delivered and self._delivered[task_id] is None
            if first:
                self._delivered[task_id] = sequence_number
        if first and self.on_watch is not None:
            self.on_watch()

    def publish(self, task_id: str, events: list[Event]) -> None:
        if not events:
            return
        if self._off_loop():
            assert self.loop is not None
            self.loop.call_soon_threadsafe(self._deliver, task_id, events)
            return
        self._deliver(task_id, events)

    def _deliver(self, task_id: str, events: list[Event]) -> None:
        with self._lock:
            if task_id in self._delivered:
                last = self._delivered[task_id]
                if last is not None:
                    events = [e for e in events if e["sequence_number"] > last]
                    if not events:
                        return
                self._delivered[task_id] = events[-1]["sequence_number"]
            targets = self._subscribers.get(task_id, set()) | self._subscribers.get(
                ALL_TASKS, set()
            )
        for sub in targets:
            for event in events:
                sub.queue.put_nowait((task_id, event))

    def watched(self) -> dict[str, int]:
        """The watched tasks whose watchers have read their log so far, with the last
        sequence number delivered (any thread)."""
        with self._lock:
            return {t: seq for t, seq in self._delivered.items() if seq is not None}

    def watcher_count(self, task_id: str) -> int:
        return len(self._subscribers.get(task_id, ()))
