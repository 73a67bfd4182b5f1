"""This server's lease as a runner (LMSP B12): its registration, its heartbeat, and the sweep
that recovers runners that died.

On its own thread, every `heartbeat_interval` seconds: renew the lease (`lease_seconds`
from now), then sweep — apply the 11.3 table to the tasks of every runner that is gone (its
process provably dead on this machine, or its lease expired), adopting the tasks that stay
unfinished (`rules.recover_at_startup`, one transaction per dead runner). What a sweep
committed, and a lease found lost, are handed to the event loop. Neither the heartbeat nor the
sweep runs on the loop: each may wait for another server's write lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable

from ..store import rules, runners
from ..store.database import Database

log = logging.getLogger(__name__)


class RunnerLease:
    def __init__(
        self,
        db: Database,
        *,
        lease_seconds: float = 15.0,
        heartbeat_interval: float = 2.0,
        label: str = "",
        kind: str = "server",
    ) -> None:
        if heartbeat_interval >= lease_seconds:
            raise ValueError("the heartbeat must come more often than the lease expires")
        self.db = db
        self.lease_seconds = lease_seconds
        self.heartbeat_interval = heartbeat_interval
        self.label = label
        self.kind = kind
        self.runner_id: str | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.on_recovered: Callable[[rules.RecoveryReport], None] | None = None
        self.on_lost: Callable[[str], None] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def register(self) -> str:
        """Register this process as a runner (before start-up recovery, which then adopts the
        tasks of its dead predecessors for it)."""
        row = runners.register(
            self.db, kind=self.kind, label=self.label, lease_seconds=self.lease_seconds
        )
        self.runner_id = row.id
        return row.id

    def start(
        self,
        loop: asyncio.AbstractEventLoop,
        on_recovered: Callable[[rules.RecoveryReport], None],
        on_lost: Callable[[str], None],
    ) -> None:
        if self._thread is not None:
            return
        self.loop, self.on_recovered, self.on_lost = loop, on_recovered, on_lost
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="lmsp-lease", daemon=True)
        self._thread.start()

    def stop(self, unregister: bool = True) -> None:
        """Stop the heartbeat; with `unregister`, give up the lease (a clean shutdown: the
        unfinished tasks become nobody's, for the next recovery by any server)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
            self._thread = None
        if unregister and self.runner_id is not None:
            try:
                runners.unregister(self.db, self.runner_id)
            except Exception:
                log.exception("LMSP: could not give up the lease of runner %s", self.runner_id)

    def _run(self) -> None:
        while not self._stop.wait(self.heartbeat_interval):
            try:
                self.beat()
            except Exception:  # a locked or busy database: try again next beat
                log.exception("LMSP: heartbeat of runner %s failed", self.runner_id)

    def beat(self) -> rules.RecoveryReport:
        """Renew the lease, then sweep for dead runners. Returns what the sweep recovered."""
        assert self.runner_id is not None
        if not runners.renew(self.db, self.runner_id, self.lease_seconds):
            lost = self.runner_id
            new = self.register()
            log.error("LMSP: runner %s lost its lease; registered again as %s", lost, new)
            self._to_loop(self.on_lost, new)
        report = rules.recover_at_startup(self.db, adopter=self.runner_id)
        if report.runners:
            log.warning(
                "LMSP: recovered the tasks of %s: %d task(s) examined%s",
                ", ".join(f"{rid or 'no runner'} ({why})" for rid, why in report.runners),
                report.examined,
                "".join(f", {k} x{v}" for k, v in sorted(report.transitions.items())),
            )
            self._to_loop(self.on_recovered, report)
        return report

    def _to_loop(self, fn: Callable[..., None] | None, *args: object) -> None:
        if fn is None or self.loop is None or self.loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            self.loop.call_soon_threadsafe(fn, *args)
