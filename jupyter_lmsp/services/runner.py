"""The task runner: takes the queued tasks it holds to the inference engine and commits what
comes back.

Its state lives on the IOLoop; its transactions do not. Engine messages arrive on the
engine's reader thread and are handed to the loop with `call_soon_threadsafe`; every state
change and every batch of text then goes through one `store.rules` transaction, run on the
runner's own database thread (`Committer`) in the order the loop asked for them, and the
committed events are published on the bus back on the loop. A transaction that waits for the
write lock (another server on the same database committing) holds up that thread, never the
loop.

A runner holds tasks (LMSP B12): those created through this server, and those it adopted
when it recovered a dead runner's. Its id (`runner_id`, the lease `services.lease` keeps) is
written on each task it takes and passed to every rule it calls, which change nothing in a
task another runner holds (the task is then dropped here). A cancel committed by another
server is noticed by `services.feed` and reaches the engine through `notice_cancelled`.

Generated tokens are coalesced for `snapshot_interval` seconds, then committed together with
the snapshot that covers them (LMSP B7): a crash loses at most that much uncommitted work, and a
resumed task continues from exactly what its watchers saw. A task's first text is committed on
the loop's next turn instead, so nobody waits up to an interval for it.

Queued tasks wait in a `FairQueue`: their owners take turns for the free slots, so one
caller's backlog never holds another's new task back by more than one turn. When every slot
is taken and an owner holds more than its share while another waits with less, one of its
running generations is paused — cancelled in the worker, its tokens committed, the task left
`running` — and queued again: it resumes from its snapshot (LMSP B7) when its turn comes, with
the tokens an uninterrupted run would give, and its watchers see one contiguous stream.

`submit`, `publish`, `cancel` and `cancelled` may be called from any thread (request handlers
may run their service calls off the loop); the rest runs on the loop.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ..engine.messages import (
    ChoiceFinished,
    GenerateJob,
    JobCancelled,
    JobFailed,
    JobFinished,
    JobStarted,
    JobTokens,
    WorkerExited,
    WorkerReady,
)
from ..protocol import events as ev
from ..protocol.errors import LMSPError
from ..protocol.objects import response_object, snapshot_of, usage_object
from ..protocol.output import Batch
from ..protocol.states import TaskState
from ..store import queries, rules
from ..store.database import Database
from ..store.tables import Response, Task
from . import metrics
from .assembly import OutputAssembler, ToolCallError
from .bus import EventBus
from .catalog import ModelCatalog
from .committer import Committer, is_locked
from .fairqueue import FairQueue, over_share
from .generation import Generation, job_for

log = logging.getLogger(__name__)


@dataclass
class _Output:
    """A running task's output: how to read the engine's tokens, and what is not committed."""

    generation: Generation
    # The raw text each choice had when the job was (re)started, for the parsers (resume).
    resumed: list[str] = field(default_factory=list)
    assembler: OutputAssembler | None = None
    ended: set[int] = field(default_factory=set)
    pending: Batch = field(default_factory=Batch)
    # When the oldest of the pending tokens arrived (monotonic), for the snapshot commit lag.
    pending_since: float = field(default_factory=time.monotonic)
    # Why the task fails, once its output could not be read (a malformed tool call).
    broken: dict[str, str] | None = None


@dataclass
class _Start:
    """What claiming a task found: the job to run, or nothing (and why)."""

    task_id: str
    job: GenerateJob | None = None
    generation: Generation | None = None
    owner: str = ""
    model: str = ""
    committed: list[rules.Committed] = field(default_factory=list)


class TaskRunner:
    def __init__(
        self,
        db: Database,
        bus: EventBus,
        catalog: ModelCatalog,
        engine_factory: Callable[[Callable[[object], None]], Any],
        *,
        snapshot_interval: float = 0.05,
        max_active: int = 8,
        runner_id: str | None = None,
        executes: bool = True,
    ) -> None:
        self.db = db
        self.bus = bus
        self.catalog = catalog
        self.engine_factory = engine_factory
        self.snapshot_interval = snapshot_interval
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
        self.committer = Committer("lmsp-runner-db")
        self.queue = FairQueue()
        # Tasks with a slot: being claimed, or handed to the engine.
        self.active: set[str] = set()
        # The batch rows each active task takes (a job with n choices takes n), and the
        # width and owner of the queued tasks wider than one row (from `submit`).
        self.rows: dict[str, int] = {}
        self.wide: dict[str, tuple[int, str]] = {}
        self.outputs: dict[str, _Output] = {}
        # One timer for all running tasks: their tokens are committed together, one
        # transaction per snapshot interval however many tasks decode at once.
        self.flush_handle: asyncio.Handle | None = None
        # Tasks whose text has begun (their first text is not held for an interval).
        self.producing: set[str] = set()
        # Tasks the engine was told to cancel (so a cancel noticed twice is sent once).
        self.cancelling: set[str] = set()
        self.cached_tokens: dict[str, int] = {}
        # Whose each active task is, and when the running ones started (for pausing one).
        self.owner_of: dict[str, str] = {}
        self.running_since: dict[str, float] = {}
        # Tasks whose generation is being paused to free a slot for another owner.
        self.pausing: set[str] = set()
        self.worker_info: dict[str, Any] = {"state": "stopped"}
        # Queue waits, token latencies, durations and the worker's figures (services.metrics).
        self.clock = metrics.RunnerClock()
        # Called with a task id once its cancel is committed (model registrations listen).
        self.cancel_listeners: list[Callable[[str], None]] = []
        # Called with the loop when the runner starts (the lease's heartbeat, the feed).
        self.start_listeners: list[Callable[[asyncio.AbstractEventLoop], None]] = []

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
            self._flush_all()
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
            if task.id not in self.active:
                self.queue.push(task.id, task.owner)
                self.clock.queued(task.id)
        self._dispatch()

    def holds(self, task_id: str) -> bool:
        """Whether this runner is running the task (any thread may ask)."""
        return task_id in self.active

    def _on_loop(self, fn: Callable[..., Any], *args: Any) -> None:
        """Call `fn` on the loop: now if this is the loop's thread, else as soon as it can."""
        if self.loop is None:
            return
        if threading.current_thread() is self.loop_thread:
            fn(*args)
        else:
            self.loop.call_soon_threadsafe(fn, *args)

    # -- requests from the services (any thread) -------------------------------------------

    def submit(self, task_id: str, owner: str, rows: int = 1) -> None:
        """A task of `owner` was committed `queued`, held by this runner: run it when a slot
        is free (and it is its owner's turn). A job of n choices takes `rows` = n slots."""
        if not self.started or not self.executes:
            return  # start() picks it up from the database; or a standalone worker will
        self._on_loop(self._submit, task_id, owner, rows)

    def _submit(self, task_id: str, owner: str, rows: int = 1) -> None:
        if rows > 1:
            self.wide[task_id] = (rows, owner)
        self.queue.push(task_id, owner)
        self.clock.submitted(task_id)
        if len(self.active) + len(self.queue) <= self.max_active:
            # It will start as soon as it is dispatched: an idle worker gathering a burst of
            # jobs waits for it instead of starting without it.
            self.engine.announce(task_id)
        # Dispatch on the next loop iteration: the request that committed the task writes its
        # reply first, without waiting for the `loading` transaction.
        assert self.loop is not None
        self.loop.call_soon(self._dispatch)

    def publish(self, committed: rules.Committed) -> None:
        if committed.events:
            self.bus.publish(committed.task.id, committed.events)

    def cancel(self, task_id: str) -> rules.Committed:
        """Ask a task to stop (any caller, any runner's task): committed in the calling
        thread; the engine hears of it if this runner runs the task. Another server's runner
        notices the `cancelling` state itself (`notice_cancelled`)."""
        committed = rules.request_cancel(self.db, task_id)
        self.cancelled(committed)
        return committed

    def cancelled(self, committed: rules.Committed) -> None:
        """Publish a committed cancel and stop the work of a task now `cancelling`."""
        self.publish(committed)
        if committed.task.state == TaskState.CANCELLING:
            self._on_loop(self.notice_cancelled, [committed.task.id])

    def notice_cancelled(self, task_ids: Iterable[str]) -> None:
        """These tasks were committed `cancelling` (here or by another server): stop their
        generation. Only the tasks this runner holds matter; each is told once.

        A cancelled generation's rows count as free at once (`_used_rows`): the next queued
        task is claimed while the worker finishes the step in flight, and its job reaches the
        worker right behind the cancel, so the worker lets one go and takes the other in the
        same turn instead of after the cancel's commit and the next claim's."""
        told = False
        for task_id in task_ids:
            if task_id in self.cancelling:
                continue
            if task_id not in self.active and self.queue.remove(task_id):
                # A generation waiting for its turn (paused, or adopted to resume): nothing
                # runs, it ends now.
                self._finish(task_id, rules.Outcome(TaskState.CANCELLED))
                continue
            if task_id in self.active and self.engine is not None:
                self.cancelling.add(task_id)
                self.engine.cancel(task_id)
                told = True
            for listener in self.cancel_listeners:
                listener(task_id)
        if told:
            self._dispatch()

    # -- dispatch --------------------------------------------------------------------------

    def _dispatch(self) -> None:
        self._fill()
        self._rebalance()
        self.clock.slots(len(self.queue), len(self.active))
        if self.engine is not None:
            # While tasks wait, the worker stops a step part-way for a cancel that frees
            # its batch (see `engine.interrupt`). Sent only when the count changes.
            self.engine.tell_slots_wanted(len(self.queue))

    def _rebalance(self) -> None:
        """Pause one generation of an owner holding more than its share of the slots while
        another owner waits with less (one pause at a time: the freed slot goes to the waiting
        owner, then the shares are looked at again)."""
        if self.pausing or not self.queue or self._used_rows() < self.max_active:
            return
        held = [self.owner_of[t] for t in self.active if t in self.owner_of]
        owner = over_share(held, self.queue.owners(), self.max_active)
        if owner is None:
            return
        candidates = [t for t, o in self.owner_of.items() if o == owner and t in self.running_since]
        if not candidates:
            return  # its tasks are still loading: not paused (they could not resume from there)
        victim = max(candidates, key=lambda t: self.running_since[t])
        log.info("pausing task %s of %s: another caller waits for a slot", victim, owner)
        self.pausing.add(victim)
        self.engine.cancel(victim)

    def _paused(self, task_id: str, output_tokens: int, task: Task | None) -> None:
        """A pause took effect (the worker let the task go, its tokens are committed): queue
        it again, unless it was cancelled meanwhile (then it ends as cancelled, as any
        cancel) or is no longer this runner's."""
        self.pausing.discard(task_id)
        if (
            task is None
            or TaskState(task.state) != TaskState.RUNNING
            or (self.runner_id is not None and task.runner_id != self.runner_id)
        ):
            self._finish(task_id, rules.Outcome(TaskState.CANCELLED), output_tokens=output_tokens)
            return
        self.active.discard(task_id)
        self.rows.pop(task_id, None)
        self.outputs.pop(task_id, None)
        self.running_since.pop(task_id, None)
        owner = self.owner_of.pop(task_id, task.owner)
        self.queue.push_paused(task_id, owner)
        self.clock.queued(task_id)
        self._dispatch()

    def _used_rows(self) -> int:
        """The batch rows the running generations take; a cancelled one's are free already
        (the worker takes a job that comes while the row is still busy in its own queue)."""
        return sum(self.rows.get(t, 1) for t in self.active if t not in self.cancelling)

    def _fill(self) -> None:
        while self.queue and self._used_rows() < self.max_active:
            task_id = self.queue.pop()
            if task_id in self.active:
                continue
            width, owner = self.wide.get(task_id, (1, ""))
            used = self._used_rows()
            if used and used + width > self.max_active:
                # A job takes all its rows at once; with nothing running it starts anyway
                # (the worker takes a job wider than its batch when idle).
                self.queue.push_front(task_id, owner)
                return
            self.active.add(task_id)  # the slot is taken while the claim commits
            self.rows[task_id] = width
            self.committer.run(self._claim, task_id, then=self._begin)

    def _claim(self, task_id: str) -> _Start:
        """(database thread) Take a queued task (`queued` → `loading`), or re-enter a resumed
        one, and prepare its job; a task that cannot start is failed here."""
        start = _Start(task_id)
        try:
            found = queries.get_task_and_response(self.db, task_id)
            if found is None:
                return start
            task, response = found
            if self.runner_id is not None and task.runner_id != self.runner_id:
                return start  # not ours (any more)
            start.owner = task.owner
            start.model = task.model
            state = TaskState(task.state)
            if state == TaskState.QUEUED:
                committed = rules.append_events(
                    self.db,
                    task_id,
                    _loading_event,
                    to_state=TaskState.LOADING,
                    only_from=[TaskState.QUEUED],
                    runner_id=self.runner_id,
                )
                if not committed.changed:
                    return start  # cancelled meanwhile
                start.committed.append(committed)
                task = committed.task
            elif state == TaskState.CANCELLING:
                # Cancelled while it waited to resume: nothing runs, it ends now.
                start.committed.append(self._end(task_id, rules.Outcome(TaskState.CANCELLED)))
                return start
            elif state != TaskState.RUNNING:
                return start  # a resumed task is `running`; anything else is not to start
            try:
                model = self.catalog.resolve(task.model)
            except LMSPError as e:
                start.committed.append(
                    self._end(
                        task_id,
                        rules.Outcome(
                            TaskState.FAILED, error={"code": e.code, "message": e.message}
                        ),
                    )
                )
                return start
            assert response is not None  # only response tasks reach the runner
            start.generation = Generation.from_params(json.loads(task.params))
            start.job = job_for(task, response, model, resume=state == TaskState.RUNNING)
        except Exception as exc:  # a bad task must not stop the queue behind it
            if is_locked(exc):
                raise  # not the task's fault: the committer runs the claim again
            log.exception("could not start task %s", task_id)
            start.job = None
            error = {"code": "server_error", "message": "The task could not start."}
            try:
                start.committed.append(self._end(task_id, rules.Outcome(TaskState.FAILED, error)))
            except Exception:
                log.exception("could not fail task %s", task_id)
        return start

    def _begin(self, start: _Start) -> None:
        for committed in start.committed:
            self.publish(committed)
            # A task that could not start ended in its claim.
            self.clock.ended(committed.task.id, committed.task.model, str(committed.task.state))
        if start.job is None or start.generation is None:
            self.active.discard(start.task_id)
            self.rows.pop(start.task_id, None)
            self._dispatch()
            return
        if start.task_id not in self.active:
            # The worker died while this claim committed: the recovery queued after it
            # applies the restart policy and queues the task again if it should run.
            return
        points = start.job.resume_points()
        self.outputs[start.task_id] = _Output(
            start.generation,
            resumed=[point.text for point in points],
            ended={i for i, point in enumerate(points) if point.finish_reason is not None},
        )
        self.rows[start.task_id] = start.generation.n
        self.owner_of[start.task_id] = start.owner
        self.clock.handed(
            start.task_id,
            start.model,
            sum(len(point.token_ids) for point in start.job.resume_points()),
        )
        self.engine.submit(start.job)

    # -- messages from the engine ----------------------------------------------------------

    def _from_engine_thread(self, message: object) -> None:
        assert self.loop is not None
        self.loop.call_soon_threadsafe(self._on_message, message)

    def _on_message(self, message: object) -> None:
        try:
            self._handle(message)
        except Exception:
            log.exception("failed to handle engine message %r", message)

    def _handle(self, message: object) -> None:
        match message:
            case WorkerReady(pid=pid, blas=blas):
                self.worker_info = {"state": "ready", "pid": pid, "blas": blas}
            case JobStarted(
                job_id=task_id, input_tokens=n, cached_tokens=cached, tool_format=tool_format
            ):
                self.cached_tokens[task_id] = cached
                self.clock.started(
                    task_id,
                    n,
                    cached,
                    message.cache_bytes,
                    message.load_seconds,
                    message.cache_reused_bytes,
                )
                if task_id in self.active:
                    self.running_since[task_id] = time.monotonic()
                output = self.outputs.get(task_id)
                if output is not None:
                    output.assembler = OutputAssembler(
                        tool_format, output.generation.function_names(), output.generation.n
                    )
                    self._read(task_id, functools.partial(_restored, output.resumed))
                self.committer.run(
                    rules.start_running,
                    self.db,
                    task_id,
                    n,
                    runner_id=self.runner_id,
                    then=self._committed,
                )
            case JobTokens(job_id=task_id, text=text) as tokens:
                self.clock.tokens(task_id, len(tokens.token_ids), tokens.batch_sizes)
                output = self.outputs.get(task_id)
                if output is not None and not output.pending:
                    output.pending_since = time.monotonic()
                if not self._read(task_id, lambda a: a.tokens(tokens)):
                    return
                assert self.loop is not None
                if self.snapshot_interval <= 0:
                    self._flush(task_id)
                elif text and task_id not in self.producing:
                    # The first text (a token may complete none, e.g. half a character):
                    # committed with whatever else is pending, on the next turn (the first
                    # tokens of a batch's other tasks arrive in the same turn).
                    self.producing.add(task_id)
                    if self.flush_handle is not None:
                        self.flush_handle.cancel()
                    self.flush_handle = self.loop.call_soon(self._flush_all)
                elif self.flush_handle is None:
                    self.flush_handle = self.loop.call_later(
                        self.snapshot_interval, self._flush_all
                    )
            case ChoiceFinished(job_id=task_id, choice=choice, finish_reason=reason):
                self._end_choice(task_id, choice, reason)
            case JobFinished(job_id=task_id, input_tokens=i, output_tokens=o, choices=choices):
                ends = [(c.choice, c.finish_reason) for c in choices] or [
                    (0, message.finish_reason)
                ]
                for choice, reason in ends:
                    self._end_choice(task_id, choice, reason)
                self.clock.accepted_drafts(task_id, message.accepted_draft_tokens)
                self._flush(task_id)
                broken = self._broken(task_id)
                if broken is not None:
                    self._finish(task_id, rules.Outcome(TaskState.FAILED, error=broken))
                    return
                cut = any(reason == "length" for _, reason in ends)
                self._finish(
                    task_id,
                    rules.Outcome(
                        TaskState.COMPLETED,
                        incomplete_reason="max_output_tokens" if cut else None,
                        usage=usage_object(
                            i,
                            o,
                            self.cached_tokens.get(task_id, 0),
                            message.accepted_draft_tokens,
                        ),
                    ),
                )
            case JobFailed(job_id=task_id, code=code, message=text):
                self._flush(task_id)
                self._finish(
                    task_id,
                    rules.Outcome(
                        TaskState.FAILED,
                        error=self._broken(task_id) or {"code": code, "message": text},
                    ),
                    corrupt=code == "model_digest_mismatch",
                )
            case JobCancelled(job_id=task_id, output_tokens=o):
                self._flush(task_id)
                broken = self._broken(task_id)
                if broken is not None:
                    # Stopped because a call it wrote could not be read: it failed.
                    self._finish(
                        task_id, rules.Outcome(TaskState.FAILED, error=broken), output_tokens=o
                    )
                    return
                if task_id in self.pausing:
                    # Paused to free its slot: its state decides (read after its tokens
                    # committed) whether it waits for its turn or ends cancelled.
                    self.committer.run(
                        queries.get_task,
                        self.db,
                        task_id,
                        then=functools.partial(self._paused, task_id, o),
                    )
                    return
                self._finish(
                    task_id,
                    rules.Outcome(TaskState.CANCELLED),
                    output_tokens=o,
                    cached_tokens=self.cached_tokens.get(task_id, 0),
                )
            case WorkerExited(job_ids=job_ids, exitcode=code):
                self._on_worker_exit(list(job_ids), code)

    def _read(self, task_id: str, step: Callable[[OutputAssembler], Batch]) -> bool:
        """Add what `step` makes of the engine's output to the task's pending batch; False
        when there is nothing to add to (an unknown task, or one whose output broke)."""
        output = self.outputs.get(task_id)
        if output is None or output.assembler is None or output.broken is not None:
            return False
        try:
            output.pending.add(step(output.assembler))
        except ToolCallError as e:
            # A call the model wrote that cannot be read: the task fails and says why, with
            # what was read before it committed; its generation stops now.
            log.warning("task %s: unreadable tool call: %s", task_id, e)
            output.broken = {"code": "tool_call_invalid", "message": f"A tool call: {e}"}
            self._flush(task_id)
            self.engine.cancel(task_id)
            return False
        return True

    def _end_choice(self, task_id: str, choice: int, reason: str) -> None:
        output = self.outputs.get(task_id)
        if output is None or choice in output.ended:
            return
        output.ended.add(choice)
        self._read(task_id, lambda a: a.end(choice, reason))

    def _broken(self, task_id: str) -> dict[str, str] | None:
        output = self.outputs.get(task_id)
        return output.broken if output is not None else None

    def _committed(self, committed: rules.Committed) -> None:
        self.publish(committed)
        if committed.lost:
            self._drop(committed.task.id)

    def _drop(self, task_id: str) -> None:
        """Another runner holds this task now (this one was declared dead while it still ran):
        stop generating it; its end changes nothing in the database."""
        if task_id in self.active and task_id not in self.cancelling and self.engine is not None:
            log.warning("task %s is held by another runner now; stopping its generation", task_id)
            self.cancelling.add(task_id)
            self.engine.cancel(task_id)
            self._dispatch()  # its rows are free now (`_used_rows`), as after a cancel

    def _flush(self, *task_ids: str) -> None:
        """Commit the output held for these tasks, in one transaction."""
        outputs = {}
        oldest = float("inf")
        for task_id in task_ids:
            output = self.outputs.get(task_id)
            if output is not None and output.pending:
                outputs[task_id] = output.pending
                output.pending = Batch()
                oldest = min(oldest, output.pending_since)
        if outputs:
            self.committer.run(
                rules.append_outputs,
                self.db,
                outputs,
                runner_id=self.runner_id,
                then=functools.partial(self._committed_outputs, oldest),
            )

    def _committed_outputs(self, oldest: float, committed: list[rules.Committed]) -> None:
        self.clock.committed_snapshot(oldest)
        for one in committed:
            self._committed(one)

    def _flush_all(self) -> None:
        self.flush_handle = None
        self._flush(*self.outputs)

    def _finish(
        self,
        task_id: str,
        outcome: rules.Outcome,
        *,
        output_tokens: int | None = None,
        corrupt: bool = False,
        cached_tokens: int = 0,
    ) -> None:
        self.committer.run(
            self._end,
            task_id,
            outcome,
            output_tokens=output_tokens,
            cached_tokens=cached_tokens,
            corrupt=corrupt,
            then=self._finished,
        )

    def _end(
        self,
        task_id: str,
        outcome: rules.Outcome,
        *,
        output_tokens: int | None = None,
        corrupt: bool = False,
        cached_tokens: int = 0,
    ) -> rules.Committed:
        """(database thread) A task's terminal transaction, with what it needs read first."""
        if corrupt or output_tokens is not None or outcome.error is not None:
            task = queries.get_task(self.db, task_id)
            if task is not None and outcome.error is not None and "message" in outcome.error:
                # An engine error may name the model's folder; a paired client may read it.
                outcome.error["message"] = self.catalog.without_paths(
                    task.model, outcome.error["message"]
                )
            if task is not None and corrupt:
                self.catalog.mark(task.model, "corrupt")
            if task is not None and output_tokens is not None:
                input_tokens = snapshot_of(task).get("input_tokens", 0)
                outcome.usage = usage_object(input_tokens, output_tokens, cached_tokens)
        return rules.finish(self.db, task_id, outcome, runner_id=self.runner_id)

    def _finished(self, committed: rules.Committed) -> None:
        task_id = committed.task.id
        self.publish(committed)
        self.clock.ended(task_id, committed.task.model, str(committed.task.state))
        self.clock.forget(task_id)  # also when the end was refused (another runner's now)
        self.active.discard(task_id)
        self.rows.pop(task_id, None)
        self.wide.pop(task_id, None)
        self.outputs.pop(task_id, None)
        self.producing.discard(task_id)
        self.cancelling.discard(task_id)
        self.cached_tokens.pop(task_id, None)
        self.owner_of.pop(task_id, None)
        self.running_since.pop(task_id, None)
        self.pausing.discard(task_id)
        self._dispatch()

    def _on_worker_exit(self, job_ids: list[str], exitcode: int | None) -> None:
        log.error("inference worker exited (code %s) holding %d task(s)", exitcode, len(job_ids))
        self.worker_info = {"state": "restarting", "last_exit_code": exitcode}
        self.clock.worker_restarted()
        held = sorted(set(job_ids) | self.active)
        self._flush(*held)
        self.active.difference_update(held)
        for task_id in held:
            self.rows.pop(task_id, None)
            self.outputs.pop(task_id, None)
        self.producing.difference_update(held)
        self.cancelling.difference_update(held)
        self.owner_of.clear()
        self.running_since.clear()
        self.pausing.clear()
        self.committer.run(
            rules.recover_after_worker_exit,
            self.db,
            held,
            runner_id=self.runner_id,
            then=self._after_worker_exit,
        )
        self.engine.restart()

    def _after_worker_exit(self, report: rules.RecoveryReport) -> None:
        metrics.recovered("worker_exit", report.by_policy)
        for committed in report.committed:
            self.publish(committed)
            # Those the restart policy ended (`fail`) end here.
            self.clock.ended(committed.task.id, committed.task.model, str(committed.task.state))
        for task_id in reversed(report.adopted):
            if task_id not in self.active:
                self.queue.push_front(task_id, report.owners[task_id])
                self.clock.queued(task_id)
        self._dispatch()

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
        self.queue = FairQueue()
        for task_id in list(self.active):
            self._drop(task_id)


def _restored(texts: list[str], assembler: OutputAssembler) -> Batch:
    """Feed a resumed task's parsers the text committed before (nothing new to commit)."""
    assembler.restore(texts)
    return Batch()


def _loading_event(task: Task, response: Response | None) -> list[dict[str, Any]]:
    if response is None:
        return [{"type": "task.loading", "task_id": task.id}]
    return [ev.lifecycle(ev.LOADING, response_object(response, task))]
