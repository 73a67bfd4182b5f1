"""The engine's messages, turned into what a task runner does with them.

The worker's messages (`engine.messages`) are read on the runner's loop (a dead worker's
`WorkerExited` comes from a thread and is handed over), where `EngineDispatcher` reads them into the task's record
(`services.running`): a job started (its output assembler, `running`), its tokens (a step's
rows come in one `StepTokens`; each row is kept for the task's next commit,
`services.output`), a choice's or the job's end, a failure, a cancel (or the pause it was),
the worker's own start and exit. What ends a task is decided here and committed through the
runner (`RunnerCommits.finish`).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..engine.messages import (
    ChoiceFinished,
    JobCancelled,
    JobFailed,
    JobFinished,
    JobStarted,
    JobTokens,
    StepTokens,
    WorkerExited,
    WorkerReady,
)
from ..protocol.objects import usage_object
from ..protocol.output import Batch
from ..protocol.states import TaskState
from ..store import queries, rules
from . import metrics
from .assembly import OutputAssembler
from .output import read, read_unread
from .running import RunningTask

if TYPE_CHECKING:
    from .runner import TaskRunner

log = logging.getLogger(__name__)


class EngineDispatcher:
    def __init__(self, runner: TaskRunner) -> None:
        self.runner = runner

    def __call__(self, message: object) -> None:
        match message:
            case WorkerReady(pid=pid, blas=blas):
                self.runner.worker_info = {"state": "ready", "pid": pid, "blas": blas}
            case JobStarted():
                self.job_started(message)
            case StepTokens(rows=rows):
                # A step's rows in one hand-off to the loop (one message per step, issue 42),
                # counted together.
                self.step_tokens(rows)
            case JobTokens():
                self.job_tokens(message)
            case ChoiceFinished(job_id=task_id, choice=choice, finish_reason=reason):
                self.choice_ended(task_id, choice, reason)
            case JobFinished(choices=choices):
                ends = [(c.choice, c.finish_reason) for c in choices] or [
                    (0, message.finish_reason)
                ]
                self.job_finished(message, ends)
            case JobFailed(job_id=task_id, code=code, message=text):
                self.job_failed(task_id, code, text)
            case JobCancelled(job_id=task_id, output_tokens=o):
                self.job_cancelled(task_id, o)
            case WorkerExited(job_ids=job_ids, exitcode=code):
                self.worker_exited(list(job_ids), code)

    def job_started(self, message: JobStarted) -> None:
        runner, task_id = self.runner, message.job_id
        runner.clock.started(
            task_id,
            message.input_tokens,
            message.cached_tokens,
            message.cache_bytes,
            message.load_seconds,
            message.cache_reused_bytes,
        )
        task = runner.slots.get(task_id)
        if task is not None:
            task.cached_tokens = message.cached_tokens
            if task.has_slot:
                task.running_since = time.monotonic()
            output = task.output
            if output is not None:
                output.assembler = OutputAssembler(
                    message.tool_format,
                    output.generation.function_names(),
                    output.generation.n,
                    output.generation.custom_names(),
                    message.thinking,
                    tools=output.generation.engine_tools(),
                )
                self._read(task, functools.partial(_restored, output.resumed))
        # The output's layout from the params parsed at the claim (not read again).
        generation = task.output.generation if task is not None and task.output else None
        runner.committer.run(
            rules.start_running,
            runner.db,
            task_id,
            message.input_tokens,
            runner_id=runner.runner_id,
            n=generation.n if generation is not None else None,
            # A message opens at once only when nothing can come before it (a call, thinking).
            eager=(
                not (generation.calls or message.thinking is not None)
                if generation is not None
                else None
            ),
            then=runner.commits.committed,
        )

    def step_tokens(self, rows: list[JobTokens]) -> None:
        """A step's rows: its metrics once, each row kept for its task's next commit."""
        runner = self.runner
        runner.clock.step(
            [(row.job_id, len(row.token_ids)) for row in rows],
            [size for row in rows for size in row.batch_sizes],
        )
        slots, output = runner.slots, runner.output
        for row in rows:
            task = slots.get(row.job_id)
            if task is not None:
                output.receive(task, row)

    def job_tokens(self, message: JobTokens) -> None:
        """One choice's tokens sent alone (as its choice ends or fails): a step of one row."""
        self.step_tokens([message])

    def choice_ended(self, task_id: str, choice: int, reason: str) -> None:
        task = self.runner.slots.get(task_id)
        if task is None or task.output is None or choice in task.output.ended:
            return
        task.output.ended.add(choice)
        self._read(task, lambda a: a.end(choice, reason))

    def job_finished(self, message: JobFinished, ends: list[tuple[int, str]]) -> None:
        task_id = message.job_id
        for choice, reason in ends:
            self.choice_ended(task_id, choice, reason)
        self.runner.clock.accepted_drafts(task_id, message.accepted_draft_tokens)
        task = self._flush(task_id)
        broken = _broken(task)
        if broken is not None:
            self.runner.commits.finish(task_id, rules.Outcome(TaskState.FAILED, error=broken))
            return
        cut = any(reason == "length" for _, reason in ends)
        usage = usage_object(
            message.input_tokens,
            message.output_tokens,
            task.cached_tokens if task is not None else 0,
            message.accepted_draft_tokens,
            message.reasoning_tokens,
        )
        self.runner.commits.finish(
            task_id,
            rules.Outcome(
                TaskState.COMPLETED,
                incomplete_reason="max_output_tokens" if cut else None,
                usage=usage,
            ),
        )

    def job_failed(self, task_id: str, code: str, message: str) -> None:
        broken = _broken(self._flush(task_id))
        self.runner.commits.finish(
            task_id,
            rules.Outcome(TaskState.FAILED, error=broken or {"code": code, "message": message}),
            corrupt=code == "model_digest_mismatch",
        )

    def job_cancelled(self, task_id: str, output_tokens: int) -> None:
        runner = self.runner
        task = self._flush(task_id)
        broken = _broken(task)
        if broken is not None:
            # Stopped because a call it wrote could not be read: it failed.
            failed = rules.Outcome(TaskState.FAILED, error=broken)
            runner.commits.finish(task_id, failed, output_tokens=output_tokens)
            return
        if task is not None and task.pausing:
            # Paused to free its slot: its state decides (read after its tokens committed)
            # whether it waits for its turn or ends cancelled.
            runner.committer.run(
                queries.get_task,
                runner.db,
                task_id,
                then=functools.partial(runner.paused, task_id, output_tokens),
            )
            return
        runner.commits.finish(
            task_id,
            rules.Outcome(TaskState.CANCELLED),
            output_tokens=output_tokens,
            cached_tokens=task.cached_tokens if task is not None else 0,
        )

    def worker_exited(self, job_ids: list[str], exitcode: int | None) -> None:
        """The worker died: commit what its tasks generated, let the restart policy decide
        what becomes of each (`rules.recover_after_worker_exit`), and start a new worker."""
        runner = self.runner
        log.error("inference worker exited (code %s) holding %d task(s)", exitcode, len(job_ids))
        runner.worker_info = {"state": "restarting", "last_exit_code": exitcode}
        runner.clock.worker_restarted()
        held = sorted(set(job_ids) | {t.task_id for t in runner.slots.active()})
        tasks = [t for t in map(runner.slots.get, held) if t is not None]
        runner.output.flush(tasks)
        for task in tasks:
            runner.slots.stopped(task)
        self.recover(held)
        runner.engine.restart()

    def recover(self, held: list[str]) -> None:
        """Apply the restart policy to tasks a dead worker held (or was about to be given:
        `services.reservations`), and queue again those it keeps."""
        runner = self.runner
        runner.committer.run(
            rules.recover_after_worker_exit,
            runner.db,
            held,
            runner_id=runner.runner_id,
            then=functools.partial(self._after_worker_exit, held),
        )

    def _after_worker_exit(self, held: list[str], report: rules.RecoveryReport) -> None:
        runner = self.runner
        metrics.recovered("worker_exit", report.by_policy)
        for committed in report.committed:
            runner.publish(committed)
            # Those the restart policy ended (`fail`) end here.
            runner.clock.ended(committed.task.id, committed.task.model, str(committed.task.state))
        for task_id in reversed(report.adopted):
            if runner.slots.push_front(task_id, report.owners[task_id]):
                runner.clock.queued(task_id)
        adopted = set(report.adopted)
        for task_id in held:
            if task_id not in adopted and not runner.slots.holds(task_id):
                runner.slots.forget(task_id)
                runner.clock.forget(task_id)
        runner.schedule()

    def _read(self, task: RunningTask, step: Callable[[OutputAssembler], Batch]) -> bool:
        """Read the engine's output into the task's pending batch (`output.read`); a task
        whose output broke now commits what was read before and stops generating. The rows
        kept for its next commit are read first (what `step` reads comes after them)."""
        added = read_unread(task)
        if added is not None:
            added = read(task, step)
        if added is None:
            self.runner.output.flush([task])
            self.broke(task)
            return False
        return added

    def broke(self, task: RunningTask) -> None:
        """The task's output broke (`RunningTask.output.broken` says why): stop generating
        it (its end fails it)."""
        self.runner.engine.cancel(task.task_id)

    def _flush(self, task_id: str) -> RunningTask | None:
        task = self.runner.slots.get(task_id)
        if task is not None:
            self.runner.output.flush([task])
        return task


def _broken(task: RunningTask | None) -> dict[str, str] | None:
    return task.output.broken if task is not None and task.output is not None else None


def _restored(texts: list[str], assembler: OutputAssembler) -> Batch:
    """Feed a resumed task's parsers the text committed before (nothing new to commit)."""
    assembler.restore(texts)
    return Batch()
