"""A task runner's transactions that start and end a task, run on its database thread
(`services.committer`), never on the loop.

`claim` takes a queued task (`queued` → `loading`, with its event), re-enters a resumed one
(`running`), or ends one cancelled while it waited; then resolves its model once and builds
the worker's job from the task's params, parsed once (`protocol.params.TaskParams`). A task
that cannot start is failed in the claim, so a bad task never stops the queue behind it.
`end` is a task's terminal transaction, with what it needs read first.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from ..engine.messages import GenerateJob
from ..protocol import events as ev
from ..protocol.errors import LMSPError
from ..protocol.objects import response_object, snapshot_of, usage_object
from ..protocol.params import TaskParams
from ..protocol.states import TaskState
from ..store import queries, rules
from ..store.database import Database
from ..store.tables import Response, Task
from .catalog import ModelCatalog
from .committer import is_locked
from .generation import Generation, job_for

log = logging.getLogger(__name__)


@dataclass
class Start:
    """What claiming a task found: the job to run, or nothing (and why)."""

    task_id: str
    job: GenerateJob | None = None
    generation: Generation | None = None
    owner: str = ""
    model: str = ""
    committed: list[rules.Committed] = field(default_factory=list)


def claim(db: Database, catalog: ModelCatalog, runner_id: str | None, task_id: str) -> Start:
    """Take a queued task (`queued` → `loading`), or re-enter a resumed one, and prepare its
    job; a task that cannot start is failed here."""
    start = Start(task_id)
    try:
        found = queries.get_task_and_response(db, task_id)
        if found is None:
            return start
        task, response = found
        if runner_id is not None and task.runner_id != runner_id:
            return start  # not ours (any more)
        start.owner = task.owner
        start.model = task.model
        state = TaskState(task.state)
        if state == TaskState.QUEUED:
            committed = rules.append_events(
                db,
                task_id,
                _loading_event,
                to_state=TaskState.LOADING,
                only_from=[TaskState.QUEUED],
                runner_id=runner_id,
            )
            if not committed.changed:
                return start  # cancelled meanwhile
            start.committed.append(committed)
            task = committed.task
        elif state == TaskState.CANCELLING:
            # Cancelled while it waited to resume: nothing runs, it ends now.
            start.committed.append(
                end(db, catalog, runner_id, task_id, rules.Outcome(TaskState.CANCELLED))
            )
            return start
        elif state != TaskState.RUNNING:
            return start  # a resumed task is `running`; anything else is not to start
        try:
            model = catalog.resolve(task.model)
        except LMSPError as e:
            failed = rules.Outcome(TaskState.FAILED, error={"code": e.code, "message": e.message})
            start.committed.append(end(db, catalog, runner_id, task_id, failed))
            return start
        assert response is not None  # only response tasks reach the runner
        params = TaskParams.load(task.params)
        start.generation = Generation.from_params(params)
        start.job = job_for(
            task, response, model, params, start.generation, resume=state == TaskState.RUNNING
        )
    except Exception as exc:  # a bad task must not stop the queue behind it
        if is_locked(exc):
            raise  # not the task's fault: the committer runs the claim again
        log.exception("could not start task %s", task_id)
        start.job = None
        error = {"code": "server_error", "message": "The task could not start."}
        try:
            failed = rules.Outcome(TaskState.FAILED, error)
            start.committed.append(end(db, catalog, runner_id, task_id, failed))
        except Exception:
            log.exception("could not fail task %s", task_id)
    return start


def end(
    db: Database,
    catalog: ModelCatalog,
    runner_id: str | None,
    task_id: str,
    outcome: rules.Outcome,
    *,
    output_tokens: int | None = None,
    corrupt: bool = False,
    cached_tokens: int = 0,
) -> rules.Committed:
    """A task's terminal transaction, with what it needs read first."""
    if corrupt or output_tokens is not None or outcome.error is not None:
        task = queries.get_task(db, task_id)
        if task is not None and outcome.error is not None and "message" in outcome.error:
            # An engine error may name the model's folder; a paired client may read it.
            outcome.error["message"] = catalog.without_paths(task.model, outcome.error["message"])
        if task is not None and corrupt:
            catalog.mark(task.model, "corrupt")
        if task is not None and output_tokens is not None:
            input_tokens = snapshot_of(task).get("input_tokens", 0)
            outcome.usage = usage_object(input_tokens, output_tokens, cached_tokens)
    return rules.finish(db, task_id, outcome, runner_id=runner_id)


def _loading_event(task: Task, response: Response | None) -> list[dict[str, Any]]:
    if response is None:
        return [{"type": "task.loading", "task_id": task.id}]
    return [ev.lifecycle(ev.LOADING, response_object(response, task))]
