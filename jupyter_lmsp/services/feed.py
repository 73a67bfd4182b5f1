"""What other servers commit to the shared database, brought to this one.

Several Jupyter servers may use one data folder (LMSP B12). Each publishes the events it
commits on its own bus; this feed makes the rest visible here, by polling from one thread:

- the events of tasks watched here (`bus.watched()`) that this server is not running itself,
  read from the event log after the last sequence number delivered, and published on the bus
  (the log is the source, so a missed poll costs latency, never an event; the bus drops what
  it delivered already);
- the tasks this server's runner holds that another server committed `cancelling`, handed to
  the runner (`notice_cancelled`), which stops their generation.

The database side is the store's (`store.feed.ChangeWatch`: its own connection, the
statements); this module schedules it. On SQLite a poll costs one `PRAGMA data_version`
(which changes when another connection commits) every `interval` seconds; the queries run
only when something changed. That is only while there is something to look for: a task
watched here, or one this runner holds (another server may cancel it). An idle server looks
every `IDLE_SECONDS` instead (an idle server polled 50 times a second, ~6 ms of CPU a second
for nothing, and woke a laptop's CPU as often), and is woken at once when a task becomes
watched (`EventBus.on_watch`) or takes a slot (`Slots.on_take`).

On PostgreSQL the thread listens instead (`LISTEN lmsp_events`, `store.notify`): each
committed event arrives as a notification naming its task and sequence number, and only the
tasks named are read — the events of those watched here, and whether one this server runs was
committed `cancelling`. Every `FULL_POLL_SECONDS` (and after reconnecting) everything watched
is read once, so a notification lost with a broken connection costs latency, never an event.

`listening` is set once the watch is open and what was committed before it has been read:
from then on, every commit reaches this server (tests wait on it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Iterable
from typing import Any

from ..store.database import Database
from ..store.feed import ChangeWatch, FeedError
from .bus import EventBus
from .runner import TaskRunner

log = logging.getLogger(__name__)

# On PostgreSQL, how often everything watched is read even without a notification.
FULL_POLL_SECONDS = 1.0
# After a failure to read or listen, the pause before connecting again.
RECONNECT_SECONDS = 1.0
# On SQLite, the pause between looks while nothing is watched here and the runner holds no task.
IDLE_SECONDS = 1.0


class EventFeed:
    def __init__(
        self, db: Database, bus: EventBus, runner: TaskRunner, interval: float = 0.02
    ) -> None:
        self.db = db
        self.bus = bus
        self.runner = runner
        self.interval = interval
        self.loop: asyncio.AbstractEventLoop | None = None
        # Set while the watch is open and caught up (see the module docstring).
        self.listening = threading.Event()
        self._stop = threading.Event()
        # Set when there may be something to look for (see the module docstring).
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        # The runner's tasks last seen `cancelling` (each is reported once).
        self._cancelling: set[str] = set()

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._thread is not None:
            return
        self.loop = loop
        self._stop.clear()
        self.bus.on_watch = self._wake.set
        self.runner.slots.on_take = self._wake.set
        self._thread = threading.Thread(target=self._run, name="lmsp-feed", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None

    def _run(self) -> None:
        if not self.db.is_postgres and self.db.path is None:
            return  # an in-memory database: this process's alone, nothing to watch
        watch = ChangeWatch(self.db)
        # PostgreSQL wakes up for notifications: a longer wait costs no latency, and still
        # notices a stop (and the periodic full read) in time.
        timeout = self.interval * 10
        try:
            while not self._stop.is_set():
                try:
                    with watch.opened():
                        self.poll(watch)  # what was committed before watching
                        self.listening.set()
                        last_full = time.monotonic()
                        while not self._stop.is_set():
                            if watch.names_tasks:
                                named: set[str] | None = watch.wait(timeout)
                            else:
                                self._pause()
                                named = watch.changed()
                            if named is None:  # something changed (SQLite)
                                self.poll(watch)
                            elif time.monotonic() - last_full >= FULL_POLL_SECONDS:
                                self.poll(watch)
                                last_full = time.monotonic()
                            elif named:
                                self.poll(watch, named)
                except FeedError:
                    self.listening.clear()
                    if self._stop.is_set():
                        return
                    log.exception("LMSP: reading the shared database failed; reconnecting")
                    self._stop.wait(RECONNECT_SECONDS)
        finally:
            self.listening.clear()
            watch.dispose()

    def _pause(self) -> None:
        """(SQLite) Wait `interval` while there is something to look for, else `IDLE_SECONDS`
        or until woken. A wake that comes between the look at `busy` and the wait ends the wait
        at once; one that comes after it is seen by the next look."""
        busy = self.runner.slots.active_count() > 0 or bool(self.bus.watched())
        self._wake.wait(self.interval if busy else IDLE_SECONDS)
        self._wake.clear()

    def poll(self, watch: ChangeWatch, only: Iterable[str] | None = None) -> None:
        """Read what changed (of the tasks `only` names, if given) and hand it to the loop."""
        named = set(only) if only is not None else None
        wanted = {
            task_id: after
            for task_id, after in self.bus.watched().items()
            # A task this server runs: its events come from this server's own commits.
            if (named is None or task_id in named) and not self.runner.holds(task_id)
        }
        batches = watch.events(wanted) if wanted else []
        cancelled: list[str] = []
        runner_id = self.runner.runner_id
        if runner_id is not None and (named is None or any(map(self.runner.holds, named))):
            now = watch.cancelling(runner_id)
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
