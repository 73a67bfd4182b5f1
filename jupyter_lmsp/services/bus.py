"""In-process fan-out of committed events to whoever watches a task (SSE streams, widgets).

Publishing happens on the IOLoop thread right after the transaction that wrote the events
committed, so a watcher never sees an event the database does not have.

A subscription may name the caller it serves; `close_caller` then ends every such subscription
(a revoked client's streams close at once): its queue receives `CLOSED`.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
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

    def close(self) -> None:
        self.bus.unsubscribe(self)

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class EventBus:
    def __init__(self) -> None:
        self._subscribers: dict[str, set[Subscription]] = defaultdict(set)

    def subscribe(self, task_id: str = ALL_TASKS, caller: str | None = None) -> Subscription:
        sub = Subscription(self, task_id, caller)
        self._subscribers[task_id].add(sub)
        return sub

    def close_caller(self, caller: str) -> int:
        """End every subscription held for `caller`; how many there were."""
        closed = 0
        for subs in list(self._subscribers.values()):
            for sub in list(subs):
                if sub.caller == caller:
                    sub.queue.put_nowait((sub.task_id, CLOSED))
                    closed += 1
        return closed

    def unsubscribe(self, sub: Subscription) -> None:
        subs = self._subscribers.get(sub.task_id)
        if subs is not None:
            subs.discard(sub)
            if not subs:
                del self._subscribers[sub.task_id]

    def publish(self, task_id: str, events: list[Event]) -> None:
        if not events:
            return
        targets = self._subscribers.get(task_id, set()) | self._subscribers.get(ALL_TASKS, set())
        for sub in targets:
            for event in events:
                sub.queue.put_nowait((task_id, event))

    def watcher_count(self, task_id: str) -> int:
        return len(self._subscribers.get(task_id, ()))
