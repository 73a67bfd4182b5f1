"""Following a task's event log: stored events after a sequence number, then live ones.

The subscription is opened before the replay query, so an event committed between the two is
in the queue; anything at or below the last sequence number already yielded is dropped. The
result is every event after `after`, exactly once, in order, with no gap, until the terminal
event.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from ..protocol.events import is_terminal
from ..store import queries
from ..store.database import Database
from .bus import EventBus

Event = dict[str, Any]


async def follow_events(
    db: Database, bus: EventBus, task_id: str, after: int = -1, idle: float = 15.0
) -> AsyncIterator[Event | None]:
    """Yield the task's events after `after`; yield None after `idle` seconds without one
    (the caller writes a keep-alive); stop after the terminal event."""
    with bus.subscribe(task_id) as sub:
        last = after
        for event in queries.list_events(db, task_id, after):
            last = event["sequence_number"]
            yield event
            if is_terminal(event):
                return
        while True:
            item = await sub.get(timeout=idle)
            if item is None:
                yield None
                continue
            _, event = item
            seq = event["sequence_number"]
            if seq <= last:
                continue
            if seq > last + 1:
                # Published events are contiguous, so a gap means this watcher fell behind a
                # replay boundary; the database has the missing ones.
                for missing in queries.list_events(db, task_id, last):
                    if missing["sequence_number"] >= seq:
                        break
                    last = missing["sequence_number"]
                    yield missing
            last = seq
            yield event
            if is_terminal(event):
                return
