"""In-process fan-out of committed events to whoever watches a task (SSE streams, widgets).

Publishing happens on the IOLoop thread right after the transaction that wrote the events
committed, so a watcher never sees an event the database does not have.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from typing import Any

Event = dict[str, Any]

ALL_TASKS = "*"


class Subscription:
    def __init__(self, bus: EventBus, task_id: str) -> None:
        self.bus = bus
        self.task_id = task_id
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

    def subscribe(self, task_id: str = ALL_TASKS) -> Subscription:
        sub = Subscription(self, task_id)
        self._subscribers[task_id].add(sub)
        return sub

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
