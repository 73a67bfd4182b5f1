"""Following a task's log (`services.follow.TaskEventStream`) on a real SQLite store: every
event after the starting point once, in order, with a gap filled from the log — and both reads
of the log (the replay and a gap's fill) on a database thread, never on the event loop's."""

from __future__ import annotations

import asyncio
import functools
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from storehelpers import events_of, make_task, open_db

from jupyter_lmsp.services import follow
from jupyter_lmsp.services.bus import EventBus
from jupyter_lmsp.store import queries, rules


def _recording_reads(monkeypatch) -> list[str]:
    """Record the thread every `queries.list_events` of the follower runs on."""
    threads: list[str] = []
    real = queries.list_events

    def list_events(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(follow.queries, "list_events", list_events)
    return threads


def _offload(executor: ThreadPoolExecutor):
    async def offload(fn: Any, *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(executor, functools.partial(fn, *args))

    return offload


def test_the_replay_reads_the_log_on_a_database_thread(tmp_path, monkeypatch):
    db = open_db(tmp_path)
    task_id = make_task(db, "completed")
    threads = _recording_reads(monkeypatch)

    async def main() -> list[dict[str, Any]]:
        bus = EventBus()
        bus.bind(asyncio.get_running_loop())
        with ThreadPoolExecutor(1, thread_name_prefix="test-db") as executor:
            stream = follow.TaskEventStream(db, bus, task_id, offload=_offload(executor))
            return [event async for event in stream if event is not None]

    got = asyncio.run(main())
    # Every event once, in order, to the terminal one, as committed.
    assert [(e["sequence_number"], e["type"]) for e in got] == [
        (e["sequence_number"], e["type"]) for e in events_of(db, task_id)
    ]
    assert got[-1]["type"] == "response.completed"
    assert threads and all(name.startswith("test-db") for name in threads), threads


def test_a_gap_is_filled_from_the_log_on_a_database_thread(tmp_path, monkeypatch):
    db = open_db(tmp_path)
    task_id = make_task(db, "running")
    threads = _recording_reads(monkeypatch)

    async def main() -> list[int]:
        bus = EventBus()
        bus.bind(asyncio.get_running_loop())
        seen: list[int] = []
        with ThreadPoolExecutor(1, thread_name_prefix="test-db") as executor:
            stream = follow.TaskEventStream(db, bus, task_id, offload=_offload(executor))
            replayed = len(events_of(db, task_id))
            while len(seen) < replayed:
                event = await stream.__anext__()
                assert event is not None
                seen.append(event["sequence_number"])
            # Two more deltas and the end are committed; only the end is published (a watcher
            # that fell behind a replay boundary): the deltas come from the log.
            rules.append_output(db, task_id, [5], " more")
            rules.append_output(db, task_id, [6], " text")
            end = rules.finish(db, task_id, rules.Outcome("failed", error=_error()))
            bus.publish(task_id, end.events)
            async for event in stream:
                assert event is not None
                seen.append(event["sequence_number"])
        return seen

    seen = asyncio.run(main())
    assert seen == list(range(len(events_of(db, task_id))))
    # The replay and the gap's fill: two reads, both off the loop.
    assert len(threads) == 2 and all(name.startswith("test-db") for name in threads), threads


def _error() -> dict[str, str]:
    return {"code": "generation_error", "message": "boom"}
