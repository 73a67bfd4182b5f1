"""How long the event loop stalls: the gaps between callbacks it was asked to run every few
milliseconds, written once a second to a file (for benchmarks and diagnosis).

A timer callback is scheduled `interval` seconds ahead, again and again; the time between two
runs is `interval` when the loop is free, and longer by however long something held the loop
(a request handler, a commit on the loop, a garbage collection). Each second one JSON line is
appended to `path`: the wall-clock time, the longest gap and the 99th percentile of the gaps
in that second (ms), and how many callbacks ran.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path


class LoopWatch:
    def __init__(self, path: str | Path, interval: float = 0.005, window: float = 1.0) -> None:
        self.path = Path(path)
        self.interval = interval
        self.window = window
        self.loop: asyncio.AbstractEventLoop | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._last = 0.0
        self._gaps: list[float] = []
        self._window_start = 0.0

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._last = self._window_start = loop.time()
        self._handle = loop.call_later(self.interval, self._tick)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._write()

    def _tick(self) -> None:
        assert self.loop is not None
        now = self.loop.time()
        self._gaps.append(now - self._last)
        self._last = now
        if now - self._window_start >= self.window:
            self._write()
            self._window_start = now
        self._handle = self.loop.call_later(self.interval, self._tick)

    def _write(self) -> None:
        if not self._gaps:
            return
        gaps = sorted(self._gaps)
        self._gaps = []
        line = {
            "time": time.time(),
            "max_ms": gaps[-1] * 1000,
            "p99_ms": gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))] * 1000,
            "ticks": len(gaps),
            "interval_ms": self.interval * 1000,
        }
        # One short line a second: appending it costs microseconds, less than handing it off.
        with open(self.path, "a") as f:
            f.write(json.dumps(line) + "\n")
