"""Which models this server's inference worker holds (issue 39).

The worker decides what stays loaded (`engine.residency`: the memory budget, idle unload) and
reports every load and unload (`ModelLoaded`, `ModelUnloaded`); `ModelResidency` reads those
reports on the loop (the runner hands it every worker message first), so `GET /models` can
show each model's state (`loaded`) and the bytes its weights take, and the metrics count loads
and unloads and show the resident bytes. `POST /models/{id}/load` and `/unload` send the
worker a `LoadModel` / `UnloadModel` and wait for its answer; a load is the same single load
any jobs of that model wait for.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from ..auth.scopes import Caller
from ..engine.messages import (
    JobFailed,
    LoadModel,
    ModelLoaded,
    ModelUnloaded,
    UnloadModel,
    WorkerExited,
)
from ..protocol.errors import LMSPError
from ..protocol.ids import new_id
from ..store.tables import Model
from . import metrics
from .embeddings import registered_files
from .engine_requests import ask_engine

if TYPE_CHECKING:
    from .context import ServiceContext
    from .runner import TaskRunner

PREFIX = "mdl_"

_STATUS = {
    "model_not_found": (404, "model_missing"),
    "model_digest_mismatch": (409, "model_corrupt"),
    "model_busy": (409, "model_busy"),
}


def _key(path: str, digest: str | None) -> str:
    return digest or path


class ModelResidency:
    def __init__(self, runner: TaskRunner) -> None:
        self.runner = runner
        # Loaded models' weight bytes, by registered digest (by folder when unregistered).
        self._loaded: dict[str, int] = {}
        self.resident_bytes = 0
        self._waiting: dict[str, asyncio.Future[Any]] = {}
        runner.engine_listeners.append(self.on_message)

    def loaded_bytes(self, model: Model) -> int | None:
        """The bytes of a model's weights if this server's worker holds it (any thread)."""
        return self._loaded.get(_key(model.path, model.digest))

    def on_message(self, message: object) -> bool:
        """A worker message, on the loop: True if it was one of these."""
        if isinstance(message, WorkerExited):
            self._loaded.clear()
            self.resident_bytes = 0
            metrics.models_resident(0, 0)
            for future in self._waiting.values():
                if not future.done():
                    future.set_exception(
                        LMSPError(
                            503,
                            "worker_restarted",
                            "The inference worker stopped; retry.",
                            type="server_error",
                        )
                    )
            self._waiting.clear()
            return False
        if isinstance(message, ModelLoaded):
            # (Loads are counted with the first job on the model: lmsp_model_loads.)
            self._loaded[_key(message.path, message.digest)] = message.nbytes
            self._resident(message.resident_bytes)
            self._answer(message.job_id, message)
            return True
        if isinstance(message, ModelUnloaded):
            if self._loaded.pop(_key(message.path, message.digest), None) is not None:
                metrics.model_unloaded(message.reason)
            self._resident(message.resident_bytes)
            self._answer(message.job_id, message)
            return True
        if isinstance(message, JobFailed) and message.job_id.startswith(PREFIX):
            status, code = _STATUS.get(message.code, (500, message.code))
            error = LMSPError(
                status,
                code,
                message.message,
                type="server_error" if status >= 500 else "invalid_request_error",
            )
            if message.job_id in self._waiting:
                future = self._waiting.pop(message.job_id)
                if not future.done():
                    future.set_exception(error)
            return True
        return False

    def _resident(self, nbytes: int) -> None:
        self.resident_bytes = nbytes
        metrics.models_resident(nbytes, len(self._loaded))

    def _answer(self, job_id: str | None, message: object) -> None:
        if job_id is None or job_id not in self._waiting:
            return
        future = self._waiting.pop(job_id)
        if not future.done():
            future.set_result(message)

    async def _ask(self, message: LoadModel | UnloadModel) -> Any:
        engine = self.runner.engine
        if engine is None:
            raise LMSPError(
                503,
                "no_local_worker",
                "This server runs no inference worker, so it loads no models.",
                type="server_error",
            )
        return await ask_engine(engine, self._waiting, message.job_id, message)

    async def load(self, model: Model, keep_alive: float | None) -> ModelLoaded:
        files = registered_files(model)
        answer: ModelLoaded = await self._ask(
            LoadModel(new_id("mdl"), model.path, files, keep_alive)
        )
        return answer

    async def unload(self, model: Model) -> ModelUnloaded:
        answer: ModelUnloaded = await self._ask(
            UnloadModel(new_id("mdl"), model.path, registered_files(model))
        )
        return answer


async def load_model(
    ctx: ServiceContext, model_id: str, keep_alive: float | None, caller: Caller
) -> dict[str, Any]:
    model = await ctx.offload(ctx.catalog.resolve, model_id)
    if ctx.residency is None:
        raise LMSPError(503, "no_local_worker", "This server loads no models.")
    try:
        await ctx.residency.load(model, keep_alive)
    except LMSPError as error:
        if error.code == "model_corrupt":
            await ctx.offload(ctx.catalog.mark, model.id, "corrupt")
        raise
    return await ctx.offload(ctx.catalog.get, model_id, caller)


async def unload_model(ctx: ServiceContext, model_id: str, caller: Caller) -> dict[str, Any]:
    model = await ctx.offload(ctx.catalog.resolve, model_id)
    if ctx.residency is None:
        raise LMSPError(503, "no_local_worker", "This server loads no models.")
    await ctx.residency.unload(model)
    return await ctx.offload(ctx.catalog.get, model_id, caller)
