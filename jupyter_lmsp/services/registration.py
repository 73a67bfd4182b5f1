"""Registering a model as a task (LMSP B4): `POST /models {"source"}` → 202 and a task that
converts (GGUF), checks and hashes the files, and records the model.

The work runs in its own process (`python -m jupyter_lmsp.models.register`), read line by line
on the event loop: progress becomes `task.progress` events; the model row is written in the
same transaction as the task's terminal state. Cancelling kills the process. At most
`concurrency` registrations run at once; the others wait `queued`, oldest first. The task is
held by this server's runner (`runner_id`, as a generation is), and its transactions run off
the event loop.

What a caller may register (docs/security.md): the owner, any path; a paired client, only
sources inside `allowed_dirs` (the model folder, the Hugging Face cache, and the folders the
owner configured), with one error for every refusal. A resolved path is registered under one
id only, and a conversion never writes into an entry of the model folder that exists. Paired
clients see no host path in what a registration reports.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from ..auth.scopes import Caller
from ..models import managed
from ..models.digests import DEFAULT_MAX_BYTES
from ..models.sources import MODEL_ID, Allowed, SourceError, resolve_source
from ..protocol.errors import LMSPError, conflict, invalid
from ..protocol.events import TaskProgressEvent
from ..protocol.ids import new_id
from ..protocol.objects import model_object, task_object
from ..protocol.registry import RegisterModelRequest
from ..protocol.states import RestartPolicy, TaskState
from ..store import models as model_store
from ..store import queries, rules
from ..store.tables import Model, Task
from . import metrics
from .admission import Admission
from .bus import EventBus
from .catalog import ModelCatalog

# A download's fields of `task.progress`, null in the events of the other stages (converting,
# hashing): the OpenAPI document lists every field of an event as present (nullable), so
# readers of the generated types can rely on that.
_PROGRESS_NULLS: dict[str, None] = {
    name: None for name, f in TaskProgressEvent.model_fields.items() if not f.is_required()
}

log = logging.getLogger(__name__)

# ServiceContext.offload: runs a function on a database thread.
Offload = Callable[..., Awaitable[Any]]

# What a paired client is told when its registration failed for a reason whose details could
# name host paths (a conversion error, a crash); the server log has the details.
_OPAQUE_FAILURE = "The model could not be registered; the server's log says why."
# Codes whose messages name nothing but the model's own files (relative names) or the id.
_PLAIN_CODES = {
    "unsafe_model_file",
    "model_too_large",
    "model_dir_exists",
    "source_unusable",
    # A download's: they name the repo and its files, never a host path.
    "download_corrupt",
    "model_not_found",
}


class ModelRegistrar:
    def __init__(
        self,
        db: Any,
        bus: EventBus,
        catalog: ModelCatalog,
        *,
        allowed_dirs: list[Path] | None = None,
        max_model_bytes: int = DEFAULT_MAX_BYTES,
        concurrency: int = 1,
        admission: Admission | None = None,
        runner_id: Callable[[], str | None] = lambda: None,
    ) -> None:
        self.db = db
        self.bus = bus
        self.catalog = catalog
        # Besides the model folder and the Hugging Face cache (read when used: the cache's
        # location follows the environment).
        self.allowed_dirs = list(allowed_dirs or [])
        self.max_model_bytes = max_model_bytes
        self.concurrency = max(1, concurrency)
        # A paired client's registrations count against its quota of unfinished tasks.
        self.admission = admission or Admission()
        # The runner (lease) this server drives tasks under, as it is now.
        self.runner_id = runner_id
        self.processes: dict[str, asyncio.subprocess.Process] = {}
        self.running: set[str] = set()
        self.started = False
        self._slots: asyncio.Semaphore | None = None

    def allowed(self) -> Allowed:
        from ..models.sources import hf_cache_dir

        return Allowed([self.catalog.model_dir, hf_cache_dir(), *self.allowed_dirs])

    def start(self) -> None:
        """Pick up registrations left unfinished (after start-up recovery)."""
        self.started = True
        self.pick_up()

    def pick_up(self) -> None:
        """Run every unfinished registration this server holds and is not running yet."""
        if self.started:
            asyncio.get_running_loop().create_task(self._pick_up())

    async def _pick_up(self) -> None:
        tasks = await asyncio.to_thread(
            queries.tasks_to_run, self.db, kind="model", runner_id=self.runner_id()
        )
        for task in tasks:
            self.submit(task.id)

    async def create(
        self, request: RegisterModelRequest, caller: Caller, offload: Offload
    ) -> dict[str, Any]:
        """Commit a registration task (queued) off the loop (its source is resolved on the
        file system there too), then start it."""
        committed = await offload(self._commit, request, caller)
        metrics.task_created("model", committed.task.model)
        self.bus.publish(committed.task.id, committed.events)
        self.submit(committed.task.id)
        return task_object(committed.task)

    def _commit(self, request: RegisterModelRequest, caller: Caller) -> rules.Committed:
        source = request.source.strip()
        restricted = not caller.is_owner
        try:
            resolved = resolve_source(source, self.allowed() if restricted else None)
        except SourceError as e:
            raise _source_error(e) from None
        model_id = request.id or resolved.suggested_id
        if not MODEL_ID.match(model_id):
            raise invalid("'id' must be 1-100 letters, digits, '.', '_' or '-'.", param="id")
        self._check_free(model_id, resolved.kind, resolved.path)
        now = time.time()
        task = Task(
            id=new_id("task"),
            kind="model",
            state=TaskState.QUEUED,
            on_restart=RestartPolicy.RETRY,
            owner=caller.id,
            model=model_id,
            params=json.dumps({"source": source, "model_id": model_id, "restricted": restricted}),
            created_at=now,
            updated_at=now,
            runner_id=self.runner_id(),
        )
        return rules.create_task(self.db, task, admit=self.admission.quota(caller, 0))

    def _check_free(self, model_id: str, kind: str, path: Path) -> None:
        """409 unless the id is free, a conversion's target does not exist, and the folder is
        not registered under another id."""
        if model_store.get_model(self.db, model_id) is not None:
            raise conflict("model_exists", f"A model with id '{model_id}' is already registered.")
        if kind == "gguf":
            if os.path.lexists(self.catalog.model_dir / model_id):
                raise conflict(
                    "model_dir_exists",
                    f"The model folder already holds an entry named '{model_id}'; a "
                    "registration never writes into something that exists. Choose another 'id'.",
                )
            return
        if kind == "hf_download":
            # Its snapshot folder is known once the hub named the commit: checked at the end.
            return
        taken = self.catalog.registered_as(path)
        if taken is not None:
            raise conflict(
                "model_path_registered",
                f"That folder is already registered as the model '{taken}'.",
            )

    def submit(self, task_id: str) -> None:
        if self.started and task_id not in self.running:
            self.running.add(task_id)
            asyncio.get_running_loop().create_task(self._run(task_id))

    def kill(self, task_id: str) -> None:
        proc = self.processes.get(task_id)
        if proc is not None and proc.returncode is None:
            proc.kill()

    def _publish(self, committed: rules.Committed) -> None:
        if committed.events:
            self.bus.publish(committed.task.id, committed.events)

    def _event(self, type_: str, **fields: Any) -> Any:
        return lambda task, _response: [{"type": type_, "task_id": task.id, **fields}]

    async def _run(self, task_id: str) -> None:
        try:
            if self._slots is None:
                self._slots = asyncio.Semaphore(self.concurrency)
            # Waiting for a slot, the task stays `queued` (and a cancel ends it at once).
            async with self._slots:
                await self._run_now(task_id)
        finally:
            self.running.discard(task_id)

    async def _run_now(self, task_id: str) -> None:
        holder = self.runner_id()
        task = await asyncio.to_thread(queries.get_task, self.db, task_id)
        if task is None or task.kind != "model" or (holder and task.runner_id != holder):
            return
        if task.state == TaskState.QUEUED:
            step = await asyncio.to_thread(
                rules.append_events,
                self.db,
                task_id,
                self._event("task.loading"),
                to_state=TaskState.LOADING,
                only_from=[TaskState.QUEUED],
                runner_id=holder,
            )
            if not step.changed:
                return
            self._publish(step)
        step = await asyncio.to_thread(
            rules.append_events,
            self.db,
            task_id,
            self._event("task.running"),
            to_state=TaskState.RUNNING,
            only_from=[TaskState.LOADING],
            runner_id=holder,
        )
        if not step.changed:
            return  # cancelled (or finished) meanwhile
        self._publish(step)
        params = json.loads(task.params)
        try:
            outcome = await self._register(task_id, params)
        except Exception as e:  # the task fails; the service stays up
            log.exception("model registration %s failed", task_id)
            outcome = rules.Outcome(
                TaskState.FAILED, error={"code": "registration_failed", "message": str(e)}
            )
        if params.get("restricted") and outcome.error is not None:
            outcome.error = _for_client(outcome.error)
        self._publish(
            await asyncio.to_thread(rules.finish, self.db, task_id, outcome, runner_id=holder)
        )
        self.catalog.forget()

    def _command(self, task_id: str, params: dict[str, Any]) -> list[str]:
        command = [
            sys.executable,
            "-m",
            "jupyter_lmsp.models.register",
            params["source"],
            "--model-dir",
            str(self.catalog.model_dir),
            "--id",
            params["model_id"],
            "--task-id",
            task_id,
            "--max-bytes",
            str(self.max_model_bytes),
        ]
        if params.get("restricted"):
            for folder in self.allowed().folders:
                command += ["--allowed", str(folder)]
        return command

    async def _register(self, task_id: str, params: dict[str, Any]) -> rules.Outcome:
        proc = await asyncio.create_subprocess_exec(
            *self._command(task_id, params),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        self.processes[task_id] = proc
        result: dict[str, Any] = {}
        try:
            assert proc.stdout is not None and proc.stderr is not None
            async for raw in proc.stdout:
                try:
                    line = json.loads(raw)
                except ValueError:
                    continue
                if "progress" in line:
                    self._publish(
                        await asyncio.to_thread(
                            rules.append_events,
                            self.db,
                            task_id,
                            self._event("task.progress", **{**_PROGRESS_NULLS, **line["progress"]}),
                            only_from=[TaskState.RUNNING],
                            runner_id=self.runner_id(),
                        )
                    )
                else:
                    result = line
            stderr = (await proc.stderr.read()).decode(errors="replace")
            await proc.wait()
        finally:
            self.processes.pop(task_id, None)
        if "model" in result:
            return self._registered(result["model"], params)
        if "error" in result:
            return rules.Outcome(TaskState.FAILED, error=result["error"])
        if proc.returncode is not None and proc.returncode < 0:
            # killed: by a cancel (the task is `cancelling`, and `finish` makes it cancelled)
            return rules.Outcome(
                TaskState.FAILED,
                error={"code": "registration_killed", "message": f"signal {-proc.returncode}"},
            )
        log.error("model registration %s failed:\n%s", task_id, stderr.strip()[-4000:])
        tail = stderr.strip().splitlines()[-1:] or ["no output"]
        return rules.Outcome(
            TaskState.FAILED,
            error={"code": "registration_failed", "message": tail[0][:500]},
        )

    def _registered(self, info: dict[str, Any], params: dict[str, Any]) -> rules.Outcome:
        row = Model(
            id=info["id"],
            format=info["format"],
            path=info["path"],
            size_bytes=info["size_bytes"],
            digest=info["digest"],
            files=json.dumps(info["files"]),
            state="available",
            source=info["source"],
            created_at=time.time(),
            managed=bool(info.get("managed")),
        )
        # Checked again now, in the same turn of the loop as the commit below: a registration
        # of the same id or folder may have finished while this one ran.
        try:
            self._check_free(row.id, "mlx", Path(row.path))
        except LMSPError as e:
            if row.managed:
                managed.remove(Path(row.path), row.id, self.catalog.model_dir)
            return rules.Outcome(TaskState.FAILED, error={"code": e.code, "message": e.message})
        shown = model_object(row, host_paths=not params.get("restricted"))
        return rules.Outcome(
            TaskState.COMPLETED,
            result={"model": shown},
            # The model's row commits with the task's end, or not at all.
            also=lambda conn: model_store.put_model(conn, row),
        )


def _source_error(e: SourceError) -> LMSPError:
    if e.code in ("source_not_found", "model_not_in_cache"):
        return LMSPError(404, e.code, e.message, param="source", type="not_found_error")
    return LMSPError(400, e.code, e.message, param="source")


def _for_client(error: dict[str, Any]) -> dict[str, Any]:
    """A failed registration's error as a paired client may see it (no host paths)."""
    if error.get("code") in _PLAIN_CODES:
        return error
    return {"code": error.get("code", "registration_failed"), "message": _OPAQUE_FAILURE}
