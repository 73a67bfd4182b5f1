"""The task runner: takes the queued tasks it holds to the inference engine and commits what
comes back.

Its state lives on the IOLoop; its transactions do not. Engine messages are read on the loop
(the engine client watches the worker's pipe there; a message from a thread goes through the
`Inbox`), and `services.dispatch` turns each into one of the runner's actions; every state change and
every batch of text then goes through one `store.rules` transaction, run on the runner's own
database thread (`Committer`) in the order the loop asked for them, and the committed events
are published on the bus back on the loop. A transaction that waits for the write lock
(another server on the same database committing) holds up that thread, never the loop.

A runner holds tasks (LMSP B12): those created through this server, and those it adopted
when it recovered a dead runner's. Its id (`runner_id`, the lease `services.lease` keeps) is
written on each task it takes and passed to every rule it calls, which change nothing in a
task another runner holds (the task is then dropped here). A cancel committed by another
server is noticed by `services.feed` and reaches the engine through `notice_cancelled`.

What it knows of each task is one `services.running.RunningTask`, kept by
`services.scheduling.Slots` (the fair queue, the slots, which generation to pause) and
forgotten in one place. Claims and ends are `services.claiming`'s transactions (a create that
finds a slot free claims its task itself: `services.reservations`); generated
tokens are read by `services.output` and committed as the worker sends them (it holds them
`snapshot_interval` seconds, a task's first text not at all), with the snapshot that covers
them (LMSP B7). When every
slot is taken and an owner holds more than its share while another waits with less, one of
its running generations is paused — cancelled in the worker, its tokens committed, the task
left `running` — and queued again: it resumes from its snapshot when its turn comes, with the
tokens an uninterrupted run would give, and its watchers see one contiguous stream.

`submit`, `publish` and `cancelled` may be called from any thread (request handlers may run
their service calls off the loop), `holds` too; the rest runs on the loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ..protocol.states import TaskState
from ..store import queries, rules
from ..store.database import Database
from ..store.tables import Task
from . import claiming, metrics
from .bus import EventBus
from .cache_keys import RecentKeys
from .catalog import ModelCatalog
from .committer import Committer
from .dispatch import EngineDispatcher
from .fairqueue import Tier, tier_of
from .inbox import Inbox
from .output import OutputStage
from .reservations import Reservations
from .runner_clock import RunnerClock
from .runner_commits import RunnerCommits
from .running import TaskOutput
from .scheduling import Slots

log = logging.getLogger(__name__)


class TaskRunner:
    def __init__(
        self,
        db: Database,
        bus: EventBus,
        catalog: ModelCatalog,
        engine_factory: Callable[[Callable[[object], None]], Any],
        *,
        max_active: int = 8,
        runner_id: str | None = None,
        executes: bool = True,
    ) -> None:
        self.db = db
        self.bus = bus
        self.catalog = catalog
        self.engine_factory = engine_factory
        self.max_active = max_active
        # The lease this runner drives tasks under (None: it claims no ownership, for tests
        # of the runner alone).
        self.runner_id = runner_id
        # False on a server without a local inference worker: it runs no generation, and the
        # tasks it creates are held by no runner (the shared queue standalone workers claim
        # from, `rules.claim_tasks`); it still commits cancels and publishes what it commits.
        self.executes = executes
        self.engine: Any = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.loop_thread: threading.Thread | None = None
        self.committer = Committer("lmsp-runner-db", group=db.grouped)
        self.slots = Slots(max_active)
        self.dispatcher = EngineDispatcher(self)
        # The engine's messages on their way to the loop (`_from_engine_thread`).
        self.inbox = Inbox(self._on_message)
        self.commits = RunnerCommits(self)
        # A create that finds a free slot claims its task itself (`services.reservations`).
        self.reservations = Reservations(self)
        self.output = OutputStage(self.commits.outputs, self.dispatcher.broke)
        self.worker_info: dict[str, Any] = {"state": "stopped"}
        # Queue waits, token latencies, durations and the worker's figures (runner_clock).
        self.clock = RunnerClock()
        # Called with a task id once its cancel is committed (model registrations listen).
        self.cancel_listeners: list[Callable[[str], None]] = []
        # Asked first about every worker message, on the loop: one that answers True took it
        # (embeddings, `services.embeddings`); every one still reaches the dispatcher otherwise.
        self.engine_listeners: list[Callable[[object], bool]] = []
        # Called with the loop when the runner starts (the lease's heartbeat, the feed).
        self.start_listeners: list[Callable[[asyncio.AbstractEventLoop], None]] = []
        # The prompt cache keys of the tasks it claimed from the shared queue, most recent
        # last: its claims prefer those keys' tasks (its worker's prompt cache holds them).
        self.recent_keys = RecentKeys()

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def started(self) -> bool:
        return self.loop is not None

    def start(self) -> None:
        """Start the engine and pick up the unfinished tasks this runner holds (after start-up
        recovery adopted them)."""
        if self.started:
            return
        self.loop = asyncio.get_running_loop()
        self.loop_thread = threading.current_thread()
        if self.bus.loop is None:
            self.bus.bind(self.loop)
        self.committer.start(self.loop)
        self.inbox.bind(self.loop)
        self.output.bind(self.loop, self.slots.active)
        if not self.executes:
            self.worker_info = {"state": "remote"}
            for listener in self.start_listeners:
                listener(self.loop)
            return
        self.engine = self.engine_factory(self._from_engine_thread)
        self.engine.start()
        self.worker_info = {"state": "starting"}
        for listener in self.start_listeners:
            listener(self.loop)
        self.pick_up()

    def stop(self) -> None:
        """Commit the text generated so far, stop the engine and the database thread."""
        if self.started:
            self.output.flush_all()
        if self.engine is not None:
            self.engine.stop()
        self.worker_info = {"state": "stopped"}
        self.committer.stop()

    @property
    def holder_id(self) -> str | None:
        """Who holds the tasks created through this server: this runner, or (without a
        local worker) no runner, for a standalone worker to claim."""
        return self.runner_id if self.executes else None

    def pick_up(self) -> None:
        """Queue every unfinished task this runner holds that it is not running yet (at
        start, and after a recovery adopted some)."""
        if not self.executes:
            return
        self.committer.run(
            queries.tasks_to_run, self.db, runner_id=self.runner_id, then=self._queue_found
        )

    def _queue_found(self, tasks: list[Task]) -> None:
        for task in tasks:
            if self.slots.push(task.id, task.owner, tier=tier_of(task)):
                self.clock.queued(task.id)
        self.schedule()

    def holds(self, task_id: str) -> bool:
        """Whether this runner is running the task (any thread may ask)."""
        return self.slots.holds(task_id)

    def room(self) -> int:
        """How many more tasks it would take: enough to keep every slot busy, and one more
        batch waiting (so a slot freed is filled without waiting for the next claim)."""
        return 2 * self.max_active - self.slots.active_count() - self.slots.waiting()

    async def claim_shared(self, models: Sequence[str] | None) -> int:
        """Claim from the shared queue as many tasks as there is room for (`room`), of these
        models (None: any), the tasks of the prompt cache keys it claimed recently first
        (within `rules.PREFER_HEAD_START`), and run them; how many it claimed (a standalone
        worker's loop)."""
        room = self.room()
        if room <= 0 or self.runner_id is None:
            return 0
        claimed = await self.committer.call(
            rules.claim_tasks,
            self.db,
            self.runner_id,
            models,
            room,
            prefer=self.recent_keys.keys(),
        )
        self.recent_keys.add(c.cache_key for c in claimed)
        for c in claimed:
            self.submit(c.task_id, c.owner)
        return len(claimed)

    def on_loop(self, fn: Callable[..., Any], *args: Any) -> None:
        """Call `fn` on the loop: now if this is the loop's thread, else as soon as it can."""
        if self.loop is None:
            return
        if threading.current_thread() is self.loop_thread:
            fn(*args)
        else:
            self.loop.call_soon_threadsafe(fn, *args)

    # -- requests from the services (any thread) -------------------------------------------

    def submit(self, task_id: str, owner: str, rows: int = 1, tier: Tier = Tier.DEFAULT) -> None:
        """A task of `owner` was committed `queued`, held by this runner: run it when a slot
        is free (and it is its owner's turn, and its tier's). A job of n choices takes `rows`
        = n slots."""
        if not self.started or not self.executes:
            return  # start() picks it up from the database; or a standalone worker will
        self.on_loop(self._submit, task_id, owner, rows, tier)

    def _submit(self, task_id: str, owner: str, rows: int = 1, tier: Tier = Tier.DEFAULT) -> None:
        self.slots.push(task_id, owner, rows, tier)
        self.clock.submitted(task_id)
        if self.slots.active_count() + self.slots.waiting() <= self.max_active:
            # It will start as soon as it is dispatched: an idle worker gathering a burst of
            # jobs waits for it instead of starting without it.
            self.engine.announce(task_id)
        # Dispatch on the next loop iteration: the request that committed the task writes its
        # reply first, without waiting for the `loading` transaction.
        assert self.loop is not None
        self.loop.call_soon(self.schedule)

    def publish(self, committed: rules.Committed) -> None:
        if committed.events:
            self.bus.publish(committed.task.id, committed.events)

    def cancelled(self, committed: rules.Committed) -> None:
        """Publish a committed cancel (`rules.request_cancel`, by any service) and stop the
        work of a task now `cancelling`."""
        self.publish(committed)
        if committed.task.state == TaskState.CANCELLING:
            self.on_loop(self.notice_cancelled, [committed.task.id])

    def notice_cancelled(self, task_ids: Iterable[str]) -> None:
        """These tasks were committed `cancelling` (here or by another server): stop their
        generation. Only the tasks this runner holds matter; each is told once.

        A cancelled generation's rows count as free at once (`Slots.used_rows`): the next
        queued task is claimed while the worker finishes the step in flight, and its job
        reaches the worker right behind the cancel, so the worker lets one go and takes the
        other in the same turn instead of after the cancel's commit and the next claim's."""
        told = False
        for task_id in task_ids:
            task = self.slots.get(task_id)
            if task is not None and task.cancelling:
                continue
            if self.slots.unqueue(task_id):
                # A generation waiting for its turn (paused, or adopted to resume): nothing
                # runs, it ends now.
                self.commits.finish(task_id, rules.Outcome(TaskState.CANCELLED))
                continue
            if task is not None and task.has_slot and self.engine is not None:
                task.cancelling = True
                self.engine.cancel(task_id)
                told = True
            for listener in self.cancel_listeners:
                listener(task_id)
        if told:
            self.schedule()

    # -- scheduling ------------------------------------------------------------------------

    def schedule(self) -> None:
        for task in self.slots.to_claim():
            self.committer.run(self.claim, task.task_id, then=self.begin)
        victim = self.slots.to_pause()
        if victim is not None:
            log.info("pausing task %s of %s: another caller waits for a slot", victim, victim.owner)
            victim.pausing = True
            self.engine.cancel(victim.task_id)
        self.clock.slots(self.slots.waiting(), self.slots.active_count())
        if self.engine is not None:
            # While tasks wait, the worker stops a step part-way for a cancel that frees
            # its batch (see `engine.interrupt`). Sent only when the count changes.
            self.engine.tell_slots_wanted(self.slots.waiting())

    def claim(self, task_id: str) -> claiming.Start:
        # (database thread) Under the runner id of the moment the claim runs (a lost lease
        # changes it).
        return claiming.claim(self.db, self.catalog, self.runner_id, task_id)

    def begin(self, start: claiming.Start) -> None:
        for committed in start.committed:
            self.publish(committed)
            # A task that could not start ended in its claim.
            self.clock.ended(committed.task.id, committed.task.model, str(committed.task.state))
        task = self.slots.get(start.task_id)
        if start.job is None or start.generation is None:
            if task is not None and task.has_slot:
                self.forget(start.task_id)
            self.schedule()
            return
        if task is None or not task.has_slot:
            # The worker died while this claim committed: the recovery queued after it
            # applies the restart policy and queues the task again if it should run.
            return
        points = start.job.resume_points()
        task.output = TaskOutput(
            start.generation,
            resumed=[point.text for point in points],
            ended={i for i, point in enumerate(points) if point.finish_reason is not None},
        )
        task.rows = start.generation.n
        task.owner = start.owner
        self.clock.handed(start.task_id, start.model, sum(len(p.token_ids) for p in points))
        self.engine.submit(start.job)

    def paused(self, task_id: str, output_tokens: int, row: Task | None) -> None:
        """A pause took effect (the worker let the task go, its tokens are committed): queue
        it again, unless it was cancelled meanwhile (then it ends as cancelled, as any
        cancel) or is no longer this runner's."""
        task = self.slots.get(task_id)
        if task is None or not task.has_slot:
            return  # its worker died meanwhile: the recovery after that decides
        task.pausing = False
        if (
            row is None
            or TaskState(row.state) != TaskState.RUNNING
            or (self.runner_id is not None and row.runner_id != self.runner_id)
        ):
            self.commits.finish(
                task_id, rules.Outcome(TaskState.CANCELLED), output_tokens=output_tokens
            )
            return
        self.slots.push_paused(task)
        self.clock.queued(task_id)
        self.schedule()

    def forget(self, task_id: str) -> None:
        """The task leaves the runner: its record, its place in the queue, its clock."""
        self.slots.forget(task_id)
        self.clock.forget(task_id)

    # -- messages from the engine ----------------------------------------------------------

    def _from_engine_thread(self, message: object) -> None:
        # Read on the loop (`EngineClient(loop=)`): handled now, after any message a thread
        # handed over before it. From a thread (the engine's reader, or the one that reaps
        # the worker): one hand-off takes the messages that piled up.
        if threading.current_thread() is self.loop_thread:
            self.inbox.handle_now(message)
        else:
            self.inbox.put(message)

    def _on_message(self, message: object) -> None:
        try:
            if any(listener(message) for listener in self.engine_listeners):
                return
            self.dispatcher(message)
        except Exception:
            log.exception("failed to handle engine message %r", message)

    # -- recoveries and a lost lease (from services.lease) ----------------------------------

    def recovered(self, report: rules.RecoveryReport) -> None:
        """A recovery (this server's sweep) committed: publish what it wrote, and run the
        tasks it adopted."""
        metrics.recovered("sweep", report.by_policy)
        for committed in report.committed:
            self.publish(committed)
        if report.adopted:
            self.pick_up()

    def lease_lost(self, new_runner_id: str) -> None:
        """Another server found this runner's lease expired and took its tasks: stop every
        generation (their commits would be refused anyway) and go on under a new lease."""
        log.error(
            "LMSP: this server's lease (runner %s) expired and its tasks were recovered by "
            "another server; continuing as runner %s",
            self.runner_id,
            new_runner_id,
        )
        self.runner_id = new_runner_id
        self.slots.clear_queue()
        for task in self.slots.active():
            self.commits.drop(task.task_id)
