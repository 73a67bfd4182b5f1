"""A task runner's transactions that start and end a task, run on its database thread
(`services.committer`), never on the loop.

`claim` takes a task to run in one store transaction (`rules.claim_to_run`: `queued` →
`loading` with its event, a resumed `running` one re-entered, or one cancelled while it waited
ended), then resolves its model once and builds the worker's job from the task's params,
parsed once (`protocol.params.TaskParams`). A task
that cannot start is failed in the claim, so a bad task never stops the queue behind it.
`end` is a task's terminal transaction, with what it needs read first.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ..engine.messages import GenerateJob
from ..protocol.errors import LMSPError
from ..protocol.objects import snapshot_of, usage_object
from ..protocol.params import TaskParams
from ..protocol.states import TaskState
from ..store import queries, rules
from ..store.database import Database
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
    """Take a task to run (`rules.claim_to_run`: one transaction), then resolve its model once
    and build its job from its params, parsed once (`prepare`); a task that cannot start is
    failed here."""
    try:
        claimed = rules.claim_to_run(db, task_id, runner_id)
    except Exception as exc:  # a bad task must not stop the queue behind it
        if is_locked(exc):
            raise  # not the task's fault: the committer runs the claim again
        return _failed(db, catalog, runner_id, Start(task_id))
    return prepare(db, catalog, runner_id, claimed, task_id)


def prepare(
    db: Database,
    catalog: ModelCatalog,
    runner_id: str | None,
    claimed: rules.Claim,
    task_id: str,
) -> Start:
    """What a committed claim starts: the job, built after the claim's commit (a create that
    claims its task, `services.reservations`, holds no write lock meanwhile); a task that
    cannot start is failed here, in a transaction of its own."""
    start = Start(task_id)
    try:
        start.committed.extend(claimed.committed)
        task, response = claimed.task, claimed.response
        if not claimed.run or task is None:
            return start  # none, not ours, ended, or ended cancelled in the claim
        start.owner = task.owner
        start.model = task.model
        try:
            model = catalog.resolve(task.model)
        except LMSPError as e:
            failed = rules.Outcome(TaskState.FAILED, error={"code": e.code, "message": e.message})
            start.committed.append(end(db, catalog, runner_id, task_id, failed))
            return start
        assert response is not None  # only response tasks reach the runner
        params = TaskParams.load(task.params)
        start.generation = Generation.from_params(params)
        start.job = job_for(task, response, model, params, start.generation, claimed.resume)
    except Exception as exc:  # a bad task must not stop the queue behind it
        if is_locked(exc):
            raise
        return _failed(db, catalog, runner_id, start)
    return start


def _failed(db: Database, catalog: ModelCatalog, runner_id: str | None, start: Start) -> Start:
    log.exception("could not start task %s", start.task_id)
    start.job = None
    start.generation = None
    error = {"code": "server_error", "message": "The task could not start."}
    try:
        failed = rules.Outcome(TaskState.FAILED, error)
        start.committed.append(end(db, catalog, runner_id, start.task_id, failed))
    except Exception:
        log.exception("could not fail task %s", start.task_id)
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
