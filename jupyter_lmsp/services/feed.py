"""What other servers commit to the shared database, brought to this one.

Several Jupyter servers may use one data folder (LMSP B12). Each publishes the events it
commits on its own bus; this feed makes the rest visible here, by polling from one thread:

- the events of tasks watched here (`bus.watched()`) that this server is not running itself,
  read from the event log after the last sequence number delivered, and published on the bus
  (the log is the source, so a missed poll costs latency, never an event; the bus drops what
  it delivered already);
- the tasks this server's runner holds that another server committed `cancelling`, handed to
  the runner (`notice_cancelled`), which stops their generation.

A poll costs one `PRAGMA data_version` (which changes when another connection commits) every
`interval` seconds; the queries run only when something changed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sqlite3
import threading
from pathlib import Path
from typing import Any

from .bus import EventBus
from .runner import TaskRunner

log = logging.getLogger(__name__)


class EventFeed:
    def __init__(
        self, path: Path, bus: EventBus, runner: TaskRunner, interval: float = 0.02
    ) -> None:
        self.path = path
        self.bus = bus
        self.runner = runner
        self.interval = interval
        self.loop: asyncio.AbstractEventLoop | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # The runner's tasks last seen `cancelling` (each is reported once).
        self._cancelling: set[str] = set()

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._thread is not None:
            return
        self.loop = loop
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="lmsp-feed", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None

    def _run(self) -> None:
        conn = sqlite3.connect(self.path, isolation_level=None, timeout=10)
        try:
            conn.execute("PRAGMA query_only=1")
            version = None
            while not self._stop.wait(self.interval):
                try:
                    (now,) = conn.execute("PRAGMA data_version").fetchone()
                    if now == version:
                        continue
                    version = now
                    self.poll(conn)
                except sqlite3.Error:
                    log.exception("LMSP: reading the shared database failed")
        finally:
            conn.close()

    def poll(self, conn: sqlite3.Connection) -> None:
        """Read what changed and hand it to the loop."""
        batches: list[tuple[str, list[dict[str, Any]]]] = []
        for task_id, after in self.bus.watched().items():
            if self.runner.holds(task_id):
                continue  # its events come from this server's own commits
            rows = conn.execute(
                "SELECT data FROM task_events WHERE task_id = ? AND sequence_number > ?"
                " ORDER BY sequence_number",
                (task_id, after),
            ).fetchall()
            if rows:
                batches.append((task_id, [json.loads(data) for (data,) in rows]))
        cancelled: list[str] = []
        runner_id = self.runner.runner_id
        if runner_id is not None:
            now = {
                task_id
                for (task_id,) in conn.execute(
                    "SELECT id FROM tasks WHERE runner_id = ? AND state = 'cancelling'",
                    (runner_id,),
                )
            }
            cancelled = sorted(now - self._cancelling)
            self._cancelling = now
        if (batches or cancelled) and self.loop is not None and not self.loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                self.loop.call_soon_threadsafe(self._deliver, batches, cancelled)

    def _deliver(
        self, batches: list[tuple[str, list[dict[str, Any]]]], cancelled: list[str]
    ) -> None:
        for task_id, events in batches:
            self.bus.publish(task_id, events)
        if cancelled:
            self.runner.notice_cancelled(cancelled)
