"""A standalone inference worker (`jupyter lmsp worker`): the MLX engine as a service of its
own, on any machine that reaches the shared database and the model files (LMSP B12).

It is a runner like a Jupyter server's (`services.runner.TaskRunner` drives the engine and
commits every event and snapshot through the `store.rules`), registered with `kind` "worker"
and a lease it renews; what it lacks is HTTP. Its work comes from the shared queue: servers
without a local worker (`LMSPExtension.local_worker = False`) create their tasks held by no
runner, and every `claim_interval` the worker claims as many as it has room for
(`rules.claim_tasks`: oldest first, of the models it serves, `FOR UPDATE SKIP LOCKED` on
PostgreSQL so that workers never take the same task). Its claims give the tasks of the
`prompt_cache_key`s it claimed recently a head start (`TaskRunner.recent_keys`): its own
inference worker's prompt cache holds their prompts. Cancels committed through any server
reach it through the feed (`services.feed`: LISTEN/NOTIFY on PostgreSQL), and stop the
generation at its next step.

When a worker dies, its lease expires (or, on the same machine, its process is seen gone) and
any server's or worker's sweep applies the 11.3 table to its tasks; the ones that stay
unfinished (`retry`: queued again; `resume`: running, to continue from its snapshot) go back
to the shared queue, and another worker claims and continues them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..store.database import Database
from .bus import EventBus
from .catalog import ModelCatalog
from .feed import EventFeed
from .lease import RunnerLease
from .runner import TaskRunner

log = logging.getLogger(__name__)


class StandaloneWorker:
    def __init__(
        self,
        db: Database,
        engine_factory: Callable[[Callable[[object], None]], Any],
        *,
        model_dir: Path,
        models: Sequence[str] = (),
        max_active: int = 8,
        lease_seconds: float = 15.0,
        heartbeat_interval: float = 2.0,
        claim_interval: float = 0.05,
        event_poll_interval: float = 0.02,
        label: str = "",
    ) -> None:
        self.db = db
        self.models = list(models)
        self.max_active = max_active
        self.claim_interval = claim_interval
        self.lease = RunnerLease(
            db,
            lease_seconds=lease_seconds,
            heartbeat_interval=heartbeat_interval,
            label=label,
            kind="worker",
            adopts=False,
        )
        runner_id = self.lease.register()
        self.bus = EventBus()
        self.runner = TaskRunner(
            db,
            self.bus,
            ModelCatalog(db, model_dir, None),
            engine_factory,
            max_active=max_active,
            runner_id=runner_id,
        )
        self.feed = EventFeed(db, self.bus, self.runner, interval=event_poll_interval)
        self.runner.start_listeners.append(self._start_background)
        self.claimed = 0

    @property
    def runner_id(self) -> str | None:
        return self.runner.runner_id

    def _start_background(self, loop: asyncio.AbstractEventLoop) -> None:
        self.lease.start(loop, self.runner.recovered, self.runner.lease_lost)
        self.feed.start(loop)

    async def run(self, stop: asyncio.Event) -> None:
        """Recover dead runners, start the engine, then claim and run tasks until `stop`."""
        report = await asyncio.to_thread(self.lease.recover)
        for dead, why in report.runners:
            log.info("LMSP worker: recovered the tasks of %s (%s)", dead or "no runner", why)
        self.runner.start()
        for committed in report.committed:
            self.runner.publish(committed)
        try:
            while not stop.is_set():
                await self._claim()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.claim_interval)
        finally:
            self.feed.stop()
            self.lease.stop(unregister=False)
            self.runner.stop()
            # Last: once the lease is given up, the unfinished tasks go back to the queue.
            self.lease.stop(unregister=True)

    async def _claim(self) -> None:
        self.claimed += await self.runner.claim_shared(self.models or None)
