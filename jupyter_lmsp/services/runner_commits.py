"""What a task runner commits besides claims: every running task's output together (the output
stage's batches, `rules.append_outputs`), and a task's end (`claiming.end`); what follows each
commit on the loop (publishing its events, freeing the slot, scheduling), and what a failed one
means for its tasks (issue 43: a full disk).

`TaskRunner` holds one (`runner.commits`); everything here runs on the runner's loop, except
`_end`, which its database thread runs.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any

from ..protocol.output import Batch
from ..protocol.states import TaskState
from ..store import rules
from . import claiming
from .committer import is_storage_full

if TYPE_CHECKING:
    from .runner import TaskRunner

log = logging.getLogger(__name__)

# The error of a task whose end could not be written as it was (issue 43).
_END_ERROR = {"code": "server_error", "message": "The task's end could not be stored."}


class RunnerCommits:
    def __init__(self, runner: TaskRunner) -> None:
        self.runner = runner

    def outputs(self, batches: dict[str, Batch], oldest: float) -> None:
        self.runner.committer.run(
            rules.append_outputs,
            self.runner.db,
            batches,
            runner_id=self.runner.runner_id,
            then=functools.partial(self._committed_outputs, oldest),
            on_error=functools.partial(self._outputs_failed, list(batches)),
        )

    def _outputs_failed(self, task_ids: list[str], exc: BaseException) -> None:
        """Their output could not be stored (a full disk, issue 43): each of those tasks fails
        rather than going on with output that is not on disk. Its job stops in the worker,
        and its end (`job_cancelled` / `job_finished`, which read `broken`) is committed as
        soon as there is room (`finish` retries a full disk)."""
        full = is_storage_full(exc)
        error = {
            "code": "storage_full" if full else "server_error",
            "message": "The server's disk is full: this response's output could not be stored."
            if full
            else "This response's output could not be stored.",
        }
        for task_id in task_ids:
            task = self.runner.slots.get(task_id)
            if task is None or task.output is None or task.output.broken is not None:
                continue
            task.output.broken = error
            if task.has_slot and self.runner.engine is not None:
                self.runner.engine.cancel(task_id)

    def _committed_outputs(self, oldest: float, committed: list[rules.Committed]) -> None:
        self.runner.clock.committed_snapshot(oldest)
        for one in committed:
            self.committed(one)

    def committed(self, committed: rules.Committed) -> None:
        self.runner.publish(committed)
        if committed.lost:
            self.drop(committed.task.id)

    def drop(self, task_id: str) -> None:
        """Another runner holds this task now (this one was declared dead while it still ran):
        stop generating it; its end changes nothing in the database."""
        task = self.runner.slots.get(task_id)
        if task is None or not task.has_slot or task.cancelling or self.runner.engine is None:
            return
        log.warning("task %s is held by another runner now; stopping its generation", task_id)
        task.cancelling = True
        self.runner.engine.cancel(task_id)
        self.runner.schedule()  # its rows are free now (`Slots.used_rows`), as after a cancel

    # -- a task's end ----------------------------------------------------------------------

    def finish(
        self,
        task_id: str,
        outcome: rules.Outcome,
        *,
        output_tokens: int | None = None,
        corrupt: bool = False,
        cached_tokens: int = 0,
    ) -> None:
        self.runner.committer.run(
            self._end,
            task_id,
            outcome,
            output_tokens=output_tokens,
            cached_tokens=cached_tokens,
            corrupt=corrupt,
            then=self._finished,
            # A task's end must land: a full disk delays it until there is room.
            retry_full=True,
            on_error=functools.partial(self._end_failed, task_id, outcome),
        )

    def _end_failed(self, task_id: str, outcome: rules.Outcome, exc: BaseException) -> None:
        """Ending the task raised (not a full disk: that is retried): end it failed instead,
        with a plain error, so it never stays `running`; its slot is freed either way."""
        if outcome.state is TaskState.FAILED and outcome.error == _END_ERROR:
            log.error("task %s could not be ended at all; its slot is freed", task_id)
            self.runner.forget(task_id)
            self.runner.schedule()
            return
        self.finish(task_id, rules.Outcome(TaskState.FAILED, error=_END_ERROR))

    def _end(self, task_id: str, outcome: rules.Outcome, **kwargs: Any) -> rules.Committed:
        # (database thread)
        return claiming.end(
            self.runner.db, self.runner.catalog, self.runner.runner_id, task_id, outcome, **kwargs
        )

    def _finished(self, committed: rules.Committed) -> None:
        task_id = committed.task.id
        self.runner.publish(committed)
        self.runner.clock.ended(task_id, committed.task.model, str(committed.task.state))
        self.runner.forget(task_id)  # also when the end was refused (another runner's now)
        self.runner.schedule()
