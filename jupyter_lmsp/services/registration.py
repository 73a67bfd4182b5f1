"""Registering a model as a task (LMSP B4): `POST /models {"source"}` → 202 and a task that
converts (GGUF), hashes, and records the model.

The work runs in its own process (`python -m jupyter_lmsp.models.register`), read line by line
on the event loop: progress becomes `task.progress` events; the model row is written in the
same transaction as the task's terminal state. Cancelling kills the process. The task is held
by this server's runner (`runner_id`, as a generation is), and its transactions run off the
event loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from collections.abc import Callable
from typing import Any

from ..auth.scopes import Caller
from ..models.sources import MODEL_ID, SourceError, resolve_source
from ..protocol.errors import LMSPError, conflict, invalid
from ..protocol.ids import new_id
from ..protocol.objects import model_object, task_object
from ..protocol.states import RestartPolicy, TaskState
from ..store import models as model_store
from ..store import queries, rules
from ..store.tables import Model, Task
from .bus import EventBus
from .catalog import ModelCatalog

log = logging.getLogger(__name__)


class ModelRegistrar:
    def __init__(
        self,
        db: Any,
        bus: EventBus,
        catalog: ModelCatalog,
        runner_id: Callable[[], str | None] = lambda: None,
    ) -> None:
        self.db = db
        self.bus = bus
        self.catalog = catalog
        # The runner (lease) this server drives tasks under, as it is now.
        self.runner_id = runner_id
        self.processes: dict[str, asyncio.subprocess.Process] = {}
        self.running: set[str] = set()
        self.started = False

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

    def create(self, body: dict[str, Any], caller: Caller) -> dict[str, Any]:
        source = body.get("source")
        if not isinstance(source, str) or not source.strip():
            raise invalid("'source' must be a path or a Hugging Face repo id.", param="source")
        unknown = set(body) - {"source", "id"}
        if unknown:
            name = sorted(unknown)[0]
            raise invalid(f"Unknown parameter: '{name}'.", param=name, code="unknown_parameter")
        try:
            resolved = resolve_source(source.strip())
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
        model_id = body.get("id") or resolved.suggested_id
        if not isinstance(model_id, str) or not MODEL_ID.match(model_id):
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
            params=json.dumps({"source": source.strip(), "model_id": model_id}),
            created_at=now,
            updated_at=now,
            runner_id=self.runner_id(),
        )
        committed = rules.create_task(self.db, task)
        self.bus.publish(task.id, committed.events)
        self.submit(task.id)
        return task_object(committed.task)

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
            await self._run_one(task_id)
        finally:
            self.running.discard(task_id)

    async def _run_one(self, task_id: str) -> None:
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
        self._publish(step)
        params = json.loads(task.params)
        try:
            outcome = await self._register(task_id, params)
        except Exception as e:  # the task fails; the service stays up
            log.exception("model registration %s failed", task_id)
            outcome = rules.Outcome(
                TaskState.FAILED, error={"code": "registration_failed", "message": str(e)}
            )
        self._publish(
            await asyncio.to_thread(rules.finish, self.db, task_id, outcome, runner_id=holder)
        )
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
                        await asyncio.to_thread(
                            rules.append_events,
                            self.db,
                            task_id,
                            self._event("task.progress", **line["progress"]),
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
