"""The task runner: takes queued tasks to the inference engine and commits what comes back.

It lives on the IOLoop. Engine messages arrive on the engine's reader thread and are handed to
the loop with `call_soon_threadsafe`; every state change and every batch of text then goes
through one `store.rules` transaction, and the committed events are published on the bus.

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
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..engine.messages import (
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
from ..protocol.states import TaskState
from ..store import queries, rules
from ..store.database import Database
from ..store.tables import Response, Task
from .bus import EventBus
from .catalog import ModelCatalog
from .conversation import stored_messages
from .fairqueue import FairQueue, over_share

log = logging.getLogger(__name__)


@dataclass
class _Pending:
    """Tokens received from the engine and not yet committed."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""


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
    ) -> None:
        self.db = db
        self.bus = bus
        self.catalog = catalog
        self.engine_factory = engine_factory
        self.snapshot_interval = snapshot_interval
        self.max_active = max_active
        self.engine: Any = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.queue = FairQueue()
        self.active: set[str] = set()
        self.pending: dict[str, _Pending] = {}
        # One timer for all running tasks: their tokens are committed together, one
        # transaction per snapshot interval however many tasks decode at once.
        self.flush_handle: asyncio.Handle | None = None
        # Tasks whose text has begun (their first text is not held for an interval).
        self.producing: set[str] = set()
        self.cached_tokens: dict[str, int] = {}
        # Whose each active task is, and when the running ones started (for pausing one).
        self.owner_of: dict[str, str] = {}
        self.running_since: dict[str, float] = {}
        # Tasks whose generation is being paused to free a slot for another owner.
        self.pausing: set[str] = set()
        self.worker_info: dict[str, Any] = {"state": "stopped"}
        # Called with a task id once its cancel is committed (model registrations listen).
        self.cancel_listeners: list[Callable[[str], None]] = []

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def started(self) -> bool:
        return self.loop is not None

    def start(self) -> None:
        """Start the engine and pick up every unfinished task (after start-up recovery)."""
        if self.started:
            return
        self.loop = asyncio.get_running_loop()
        self.engine = self.engine_factory(self._from_engine_thread)
        self.engine.start()
        self.worker_info = {"state": "starting"}
        for task in queries.tasks_to_run(self.db):
            self.queue.push(task.id, task.owner)
        self._dispatch()

    def stop(self) -> None:
        if self.engine is not None:
            self.engine.stop()
        self.worker_info = {"state": "stopped"}

    # -- requests from the services --------------------------------------------------------

    def submit(self, task_id: str, owner: str) -> None:
        """A task of `owner` was committed `queued`: run it when a slot is free (and it is its
        owner's turn)."""
        if not self.started:
            return  # start() picks it up from the database
        self.queue.push(task_id, owner)
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
        committed = rules.request_cancel(self.db, task_id)
        self.cancelled(committed)
        return committed

    def cancelled(self, committed: rules.Committed) -> None:
        """Act on a committed cancel request (`rules.request_cancel`, run off the loop by a
        request): publish its events, and stop the generation or registration it cancels."""
        self.publish(committed)
        task_id = committed.task.id
        if committed.task.state == TaskState.CANCELLING:
            if task_id not in self.active and self.queue.remove(task_id):
                # A paused generation waiting for its turn: nothing runs, it ends now.
                self._finish(task_id, rules.Outcome(TaskState.CANCELLED))
                return
            if task_id in self.active:
                self.engine.cancel(task_id)
            for listener in self.cancel_listeners:
                listener(task_id)

    # -- dispatch --------------------------------------------------------------------------

    def _dispatch(self) -> None:
        self._fill()
        self._rebalance()

    def _rebalance(self) -> None:
        """Pause one generation of an owner holding more than its share of the slots while
        another owner waits with less (one pause at a time: the freed slot goes to the waiting
        owner, then the shares are looked at again)."""
        if self.pausing or not self.queue or len(self.active) < self.max_active:
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

    def _paused(self, task_id: str) -> bool:
        """A pause took effect (the worker let the task go): queue it again, unless it was
        cancelled meanwhile (then it ends as cancelled, as any cancel)."""
        self.pausing.discard(task_id)
        task = queries.get_task(self.db, task_id)
        if task is None or TaskState(task.state) != TaskState.RUNNING:
            return False
        self.active.discard(task_id)
        self.running_since.pop(task_id, None)
        owner = self.owner_of.pop(task_id, task.owner)
        self.queue.push_paused(task_id, owner)
        self._dispatch()
        return True

    def _fill(self) -> None:
        while self.queue and len(self.active) < self.max_active:
            task_id = self.queue.pop()
            if task_id in self.active:
                continue
            try:
                self._begin(task_id)
            except Exception:  # a bad task must not stop the queue behind it
                log.exception("could not start task %s", task_id)
                self._finish(
                    task_id,
                    rules.Outcome(
                        TaskState.FAILED,
                        error={"code": "server_error", "message": "The task could not start."},
                    ),
                )

    def _begin(self, task_id: str) -> None:
        found = queries.get_task_and_response(self.db, task_id)
        if found is None:
            return
        task, response = found
        state = TaskState(task.state)
        if state == TaskState.QUEUED:
            committed = rules.append_events(
                self.db,
                task_id,
                _loading_event,
                to_state=TaskState.LOADING,
                only_from=[TaskState.QUEUED],
            )
            if not committed.changed:
                return  # cancelled meanwhile
            self.publish(committed)
            task = committed.task
        elif state != TaskState.RUNNING:
            return  # a resumed task is `running`; anything else is not ours to start
        try:
            model = self.catalog.resolve(task.model)
        except LMSPError as e:
            self._finish(
                task_id,
                rules.Outcome(TaskState.FAILED, error={"code": e.code, "message": e.message}),
            )
            return
        params = json.loads(task.params)
        snap = snapshot_of(task) if state == TaskState.RUNNING else {}
        assert response is not None  # only response tasks reach the runner
        job = GenerateJob(
            job_id=task_id,
            model_path=str(model.path),
            messages=stored_messages(response, task),
            max_tokens=params["max_tokens"],
            temperature=params["temperature"],
            top_p=params["top_p"],
            seed=params["seed"],
            resume_token_ids=list(snap.get("token_ids", [])),
            resume_text=snap.get("text", ""),
            expected_files=json.loads(model.files) if model.files else None,
        )
        self.active.add(task_id)
        self.owner_of[task_id] = task.owner
        self.engine.submit(job)

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
            case JobStarted(job_id=task_id, input_tokens=n, cached_tokens=cached):
                self.cached_tokens[task_id] = cached
                self.running_since[task_id] = time.monotonic()
                self.publish(rules.start_running(self.db, task_id, n))
            case JobTokens(job_id=task_id, token_ids=ids, text=text):
                pending = self.pending.setdefault(task_id, _Pending())
                pending.token_ids.extend(ids)
                pending.text += text
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
            case JobFinished(job_id=task_id, finish_reason=reason, input_tokens=i, output_tokens=o):
                self._flush(task_id)
                self._finish(
                    task_id,
                    rules.Outcome(
                        TaskState.COMPLETED,
                        incomplete_reason="max_output_tokens" if reason == "length" else None,
                        usage=usage_object(i, o, self.cached_tokens.get(task_id, 0)),
                    ),
                )
            case JobFailed(job_id=task_id, code=code, message=text):
                self._flush(task_id)
                task = queries.get_task(self.db, task_id)
                if task is not None:
                    text = self.catalog.without_paths(task.model, text)
                if code == "model_digest_mismatch" and task is not None:
                    self.catalog.mark(task.model, "corrupt")
                self._finish(
                    task_id,
                    rules.Outcome(TaskState.FAILED, error={"code": code, "message": text}),
                )
            case JobCancelled(job_id=task_id, output_tokens=o):
                self._flush(task_id)
                if task_id in self.pausing and self._paused(task_id):
                    return
                self._finish(
                    task_id, rules.Outcome(TaskState.CANCELLED, usage=self._usage(task_id, o))
                )
            case WorkerExited(job_ids=job_ids, exitcode=code):
                self._on_worker_exit(list(job_ids), code)

    def _flush(self, *task_ids: str) -> None:
        """Commit the tokens held for these tasks, in one transaction."""
        outputs = {}
        for task_id in task_ids:
            pending = self.pending.pop(task_id, None)
            if pending is not None and (pending.token_ids or pending.text):
                outputs[task_id] = (pending.token_ids, pending.text)
        if outputs:
            for committed in rules.append_outputs(self.db, outputs):
                self.publish(committed)

    def _flush_all(self) -> None:
        self.flush_handle = None
        self._flush(*self.pending)

    def _finish(self, task_id: str, outcome: rules.Outcome) -> None:
        self.publish(rules.finish(self.db, task_id, outcome))
        self.active.discard(task_id)
        self.producing.discard(task_id)
        self.cached_tokens.pop(task_id, None)
        self.owner_of.pop(task_id, None)
        self.running_since.pop(task_id, None)
        self.pausing.discard(task_id)
        self._dispatch()

    def _usage(self, task_id: str, output_tokens: int) -> dict[str, Any] | None:
        task = queries.get_task(self.db, task_id)
        if task is None:
            return None
        return usage_object(snapshot_of(task).get("input_tokens", 0), output_tokens)

    def _on_worker_exit(self, job_ids: list[str], exitcode: int | None) -> None:
        log.error("inference worker exited (code %s) holding %d task(s)", exitcode, len(job_ids))
        self.worker_info = {"state": "restarting", "last_exit_code": exitcode}
        held = sorted(set(job_ids) | self.active)
        self._flush(*held)
        self.active.clear()
        self.owner_of.clear()
        self.running_since.clear()
        self.pausing.clear()
        self.producing.difference_update(held)
        report = rules.recover_after_worker_exit(self.db, held)
        for committed in report.committed:
            self.publish(committed)
        self.engine.restart()
        for task_id in reversed(held):
            task = queries.get_task(self.db, task_id)
            if task is not None and task.state in (TaskState.QUEUED, TaskState.RUNNING):
                self.queue.push_front(task_id, task.owner)
        self._dispatch()


def _loading_event(task: Task, response: Response | None) -> list[dict[str, Any]]:
    if response is None:
        return [{"type": "task.loading", "task_id": task.id}]
    return [ev.lifecycle(ev.LOADING, response_object(response, task))]
