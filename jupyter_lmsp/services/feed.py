"""What other servers commit to the shared database, brought to this one.

Several Jupyter servers may use one data folder (LMSP B12). Each publishes the events it
commits on its own bus; this feed makes the rest visible here, by polling from one thread:

- the events of tasks watched here (`bus.watched()`) that this server is not running itself,
  read from the event log after the last sequence number delivered, and published on the bus
  (the log is the source, so a missed poll costs latency, never an event; the bus drops what
  it delivered already);
- the tasks this server's runner holds that another server committed `cancelling`, handed to
  the runner (`notice_cancelled`), which stops their generation.

On SQLite a poll costs one `PRAGMA data_version` (which changes when another connection
commits) every `interval` seconds; the queries run only when something changed.

On PostgreSQL the thread listens instead (`LISTEN lmsp_events`, `store.notify`): each
committed event arrives as a notification naming its task and sequence number, and only the
tasks named are read — the events of those watched here, and whether one this server runs was
committed `cancelling`. Every `FULL_POLL_SECONDS` (and after reconnecting) everything watched
is read once, so a notification lost with a broken connection costs latency, never an event.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sqlite3
import threading
import time
from collections.abc import Iterable
from typing import Any

from ..store import notify
from ..store.database import Database
from ..store.dialect import PgCursor
from .bus import EventBus
from .runner import TaskRunner

log = logging.getLogger(__name__)

# On PostgreSQL, how often everything watched is read even without a notification.
FULL_POLL_SECONDS = 1.0


class _PgReader:
    """A psycopg connection read with statements in SQLite's parameter style."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn

    def execute(self, sql: str, params: Any = ()) -> PgCursor:
        return PgCursor(self.conn).execute(sql, params)


class EventFeed:
    def __init__(
        self, db: Database, bus: EventBus, runner: TaskRunner, interval: float = 0.02
    ) -> None:
        self.db = db
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
        if self.db.is_postgres:
            self._listen()
            return
        assert self.db.path is not None
        conn = sqlite3.connect(self.db.path, isolation_level=None, timeout=10)
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

    def _listen(self) -> None:
        import psycopg

        dsn = self.db.engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
        while not self._stop.is_set():
            try:
                with psycopg.connect(dsn, autocommit=True) as conn:
                    conn.execute(f"LISTEN {notify.CHANNEL}")
                    reader = _PgReader(conn)
                    self.poll(reader)  # what was committed before listening
                    last_full = time.monotonic()
                    while not self._stop.is_set():
                        named: set[str] = set()
                        for note in conn.notifies(timeout=self.interval * 10, stop_after=1):
                            parsed = notify.parse(note.payload)
                            if parsed is not None:
                                named.add(parsed[0])
                        # Whatever else arrived meanwhile, without waiting.
                        for note in conn.notifies(timeout=0):
                            parsed = notify.parse(note.payload)
                            if parsed is not None:
                                named.add(parsed[0])
                        if time.monotonic() - last_full >= FULL_POLL_SECONDS:
                            self.poll(reader)
                            last_full = time.monotonic()
                        elif named:
                            self.poll(reader, named)
            except psycopg.Error:
                if self._stop.is_set():
                    return
                log.exception("LMSP: listening to the shared database failed; reconnecting")
                self._stop.wait(1.0)

    def poll(self, conn: Any, only: Iterable[str] | None = None) -> None:
        """Read what changed (of the tasks `only` names, if given) and hand it to the loop."""
        batches: list[tuple[str, list[dict[str, Any]]]] = []
        named = set(only) if only is not None else None
        for task_id, after in self.bus.watched().items():
            if named is not None and task_id not in named:
                continue
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
        if runner_id is not None and (named is None or any(map(self.runner.holds, named))):
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
