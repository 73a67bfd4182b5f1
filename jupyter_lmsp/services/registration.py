"""Registering a model as a task (LMSP B4): `POST /models {"source"}` → 202 and a task that
converts (GGUF), hashes, and records the model.

The work runs in its own process (`python -m jupyter_lmsp.models.register`), read line by line
on the event loop: progress becomes `task.progress` events; the model row is written in the
same transaction as the task's terminal state. Cancelling kills the process.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

from ..auth.scopes import Caller
from ..models.sources import MODEL_ID, SourceError, resolve_source
from ..protocol.errors import LMSPError, conflict, invalid
from ..protocol.ids import new_id
from ..protocol.objects import model_object, task_object
from ..protocol.registry import RegisterModelRequest
from ..protocol.states import RestartPolicy, TaskState
from ..store import models as model_store
from ..store import queries, rules
from ..store.tables import Model, Task
from .bus import EventBus
from .catalog import ModelCatalog

log = logging.getLogger(__name__)

# ServiceContext.offload: runs a function on a database thread.
Offload = Callable[..., Awaitable[Any]]


class ModelRegistrar:
    def __init__(self, db: Any, bus: EventBus, catalog: ModelCatalog) -> None:
        self.db = db
        self.bus = bus
        self.catalog = catalog
        self.processes: dict[str, asyncio.subprocess.Process] = {}
        self.started = False

    def start(self) -> None:
        """Pick up registrations left unfinished (after start-up recovery)."""
        self.started = True
        for task in queries.tasks_to_run(self.db, kind="model"):
            self.submit(task.id)

    async def create(
        self, request: RegisterModelRequest, caller: Caller, offload: Offload
    ) -> dict[str, Any]:
        """Commit a registration task (queued) off the loop, then start it."""
        committed = await offload(self._commit, request, caller)
        self.bus.publish(committed.task.id, committed.events)
        self.submit(committed.task.id)
        return task_object(committed.task)

    def _commit(self, request: RegisterModelRequest, caller: Caller) -> rules.Committed:
        source = request.source.strip()
        try:
            resolved = resolve_source(source)
        except SourceError as e:
            raise LMSPError(
                404 if e.code in ("source_not_found", "model_not_in_cache") else 400,
                e.code,
                e.message,
                param="source",
                type="not_found_error"
                if e.code != "unsupported_source"
                else "invalid_request_error",
            ) from None
        model_id = request.id or resolved.suggested_id
        if not MODEL_ID.match(model_id):
            raise invalid("'id' must be 1-100 letters, digits, '.', '_' or '-'.", param="id")
        if model_store.get_model(self.db, model_id) is not None:
            raise conflict("model_exists", f"A model with id '{model_id}' is already registered.")
        now = time.time()
        task = Task(
            id=new_id("task"),
            kind="model",
            state=TaskState.QUEUED,
            on_restart=RestartPolicy.RETRY,
            owner=caller.id,
            model=model_id,
            params=json.dumps({"source": source, "model_id": model_id}),
            created_at=now,
            updated_at=now,
        )
        return rules.create_task(self.db, task)

    def submit(self, task_id: str) -> None:
        if self.started:
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
        task = queries.get_task(self.db, task_id)
        if task is None or task.kind != "model":
            return
        if task.state == TaskState.QUEUED:
            step = rules.append_events(
                self.db,
                task_id,
                self._event("task.loading"),
                to_state=TaskState.LOADING,
                only_from=[TaskState.QUEUED],
            )
            if not step.changed:
                return
            self._publish(step)
        step = rules.append_events(
            self.db,
            task_id,
            self._event("task.running"),
            to_state=TaskState.RUNNING,
            only_from=[TaskState.LOADING],
        )
        self._publish(step)
        params = json.loads(task.params)
        try:
            outcome = await self._register(task_id, params)
        except Exception as e:  # the task fails; the service stays up
            log.exception("model registration %s failed", task_id)
            outcome = rules.Outcome(
                TaskState.FAILED, error={"code": "registration_failed", "message": str(e)}
            )
        self._publish(rules.finish(self.db, task_id, outcome))
        self.catalog.forget()

    async def _register(self, task_id: str, params: dict[str, Any]) -> rules.Outcome:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "jupyter_lmsp.models.register",
            params["source"],
            "--model-dir",
            str(self.catalog.model_dir),
            "--id",
            params["model_id"],
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
                        rules.append_events(
                            self.db,
                            task_id,
                            self._event("task.progress", **line["progress"]),
                            only_from=[TaskState.RUNNING],
                        )
                    )
                else:
                    result = line
            stderr = (await proc.stderr.read()).decode(errors="replace")
            await proc.wait()
        finally:
            self.processes.pop(task_id, None)
        if "model" in result:
            info = result["model"]
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
            )
            return rules.Outcome(
                TaskState.COMPLETED,
                result={"model": model_object(row)},
                also=lambda session: session.merge(row),
            )
        if "error" in result:
            return rules.Outcome(TaskState.FAILED, error=result["error"])
        if proc.returncode is not None and proc.returncode < 0:
            # killed: by a cancel (the task is `cancelling`, and `finish` makes it cancelled)
            return rules.Outcome(
                TaskState.FAILED,
                error={"code": "registration_killed", "message": f"signal {-proc.returncode}"},
            )
        tail = stderr.strip().splitlines()[-1:] or ["no output"]
        return rules.Outcome(
            TaskState.FAILED,
            error={"code": "registration_failed", "message": tail[0][:500]},
        )
