"""The event-loop stall monitor (`LMSPExtension.loop_watch_path`, for benchmarks): a callback
that holds the loop shows up as a gap of at least that long, and a free loop as gaps close to
the timer's interval."""

from __future__ import annotations

import asyncio
import json
import time

from jupyter_lmsp.services.loopwatch import LoopWatch


def test_a_held_loop_shows_as_a_gap_and_a_free_one_does_not(tmp_path):
    path = tmp_path / "loop.jsonl"

    async def run() -> None:
        watch = LoopWatch(path, interval=0.005, window=0.2)
        watch.start(asyncio.get_running_loop())
        await asyncio.sleep(0.5)  # free
        time.sleep(0.3)  # the loop is held for 300 ms
        await asyncio.sleep(0.3)
        watch.stop()

    asyncio.run(run())
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert len(lines) >= 3
    assert max(x["max_ms"] for x in lines) >= 300
    free = lines[0]
    assert free["max_ms"] < 250 and free["ticks"] > 5
