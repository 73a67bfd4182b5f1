"""Embeddings (issue 39): `POST /embeddings` answered by the inference worker.

An embedding request is no task: like OpenAI's it is answered at once, with nothing stored.
Its model is resolved in the registry (the default model when none is named) and its inputs
go to the worker as one `EmbedJob`, with the model's registered files, so the model is
verified and loaded exactly as for generation (`engine.loader`). The worker computes
embeddings between decode steps, batching the inputs of requests that wait together
(`engine.embedding`), and answers with an `EmbedResult`; the runner hands every worker message
whose job id is an embedding's to `Embedder.on_message` first, on the loop. The vectors are
turned into the JSON answer off the loop (a long list of numbers takes milliseconds to write).

A client that goes away cancels its job in the worker; a worker that dies fails every
embedding in flight with a 503 (the worker restarts; retrying is safe: nothing was stored).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from typing import TYPE_CHECKING, Any

from ..engine.embedding import is_embedding_model
from ..engine.messages import (
    EmbedJob,
    EmbedResult,
    JobCancelled,
    JobFailed,
    WorkerExited,
)
from ..protocol.embeddings import CreateEmbeddingRequest
from ..protocol.errors import LMSPError
from ..protocol.ids import new_id
from ..store.tables import Model
from .engine_requests import ask_engine

if TYPE_CHECKING:
    from .context import ServiceContext
    from .runner import TaskRunner

log = logging.getLogger(__name__)

PREFIX = "emb_"

# A worker's refusal, as the answer's status and code.
_STATUS = {
    "invalid_input": (400, "invalid_value", "input"),
    "invalid_dimensions": (400, "invalid_value", "dimensions"),
    "invalid_request": (400, "invalid_value", "input"),
    "embedding_unsupported": (400, "embedding_unsupported", "model"),
    "model_not_found": (404, "model_missing", "model"),
    "model_digest_mismatch": (409, "model_corrupt", "model"),
}


def registered_files(model: Model) -> list[dict[str, Any]] | None:
    files = json.loads(model.files) if model.files else None
    return files if isinstance(files, list) else None


def embedding_only(model: Model) -> bool:
    """Whether a registered model is an embedding model (`engine.embedding`), which makes no
    text: it refuses chat and responses."""
    files = registered_files(model) or []
    return is_embedding_model(str(f.get("path", "")) for f in files if isinstance(f, dict))


def refuse_chat(model: Model) -> None:
    """A 400 for generating text with an embedding model."""
    if embedding_only(model):
        raise LMSPError(
            400,
            "model_embedding_only",
            f"The model '{model.id}' is an embedding model: it makes vectors, not text. "
            "Use it with POST /embeddings.",
            param="model",
        )


class Embedder:
    """The embeddings waiting for the worker, by job id (on the loop)."""

    def __init__(self, runner: TaskRunner) -> None:
        self.runner = runner
        self._waiting: dict[str, asyncio.Future[EmbedResult]] = {}
        runner.engine_listeners.append(self.on_message)

    def on_message(self, message: object) -> bool:
        """A worker message, on the loop: True if it was an embedding's."""
        if isinstance(message, WorkerExited):
            for future in self._waiting.values():
                if not future.done():
                    future.set_exception(
                        LMSPError(
                            503,
                            "worker_restarted",
                            "The inference worker stopped while computing the embeddings; "
                            "retry the request.",
                            type="server_error",
                        )
                    )
            self._waiting.clear()
            return False
        job_id = getattr(message, "job_id", None)
        if not (isinstance(job_id, str) and job_id.startswith(PREFIX)):
            return False
        if job_id not in self._waiting:
            return True
        future = self._waiting.pop(job_id)
        if future.done():
            return True
        if isinstance(message, EmbedResult):
            future.set_result(message)
        elif isinstance(message, JobFailed):
            status, code, param = _STATUS.get(message.code, (500, message.code, None))
            future.set_exception(
                LMSPError(
                    status,
                    code,
                    message.message,
                    type="invalid_request_error" if status < 500 else "server_error",
                    param=param,
                )
            )
        elif isinstance(message, JobCancelled):
            future.set_exception(
                LMSPError(503, "server_shutting_down", "The worker is stopping; retry.")
            )
        return True

    async def embed(self, model: Model, request: CreateEmbeddingRequest) -> EmbedResult:
        engine = self.runner.engine
        if engine is None:
            raise LMSPError(
                503,
                "no_local_worker",
                "This server runs no inference worker, so it computes no embeddings.",
                type="server_error",
            )
        job = EmbedJob(
            new_id("emb"),
            model.path,
            request.inputs(),
            request.dimensions,
            registered_files(model),
            keep_alive=request.keep_alive,
        )
        result: EmbedResult = await ask_engine(engine, self._waiting, job.job_id, job)
        return result


def answer(model_id: str, result: EmbedResult, encoding_format: str) -> bytes:
    """The JSON answer (OpenAI's list shape) for a result: run it off the loop."""
    import numpy as np  # here: a server that never embeds never imports it

    vectors = np.frombuffer(result.vectors, dtype="<f4").reshape(result.count, result.size)
    data: list[dict[str, Any]] = []
    for index, vector in enumerate(vectors):
        value: Any = (
            base64.b64encode(vector.tobytes()).decode("ascii")
            if encoding_format == "base64"
            else vector.tolist()
        )
        data.append({"object": "embedding", "index": index, "embedding": value})
    body = {
        "object": "list",
        "data": data,
        "model": model_id,
        "usage": {"prompt_tokens": result.input_tokens, "total_tokens": result.input_tokens},
    }
    return json.dumps(body).encode()


async def create_embeddings(ctx: ServiceContext, request: CreateEmbeddingRequest) -> bytes:
    model = await ctx.offload(ctx.catalog.resolve, request.model)
    if ctx.embedder is None:
        raise LMSPError(503, "no_local_worker", "This server computes no embeddings.")
    try:
        result = await ctx.embedder.embed(model, request)
    except LMSPError as error:
        if error.code == "model_corrupt":
            await ctx.offload(ctx.catalog.mark, model.id, "corrupt")
        raise
    return await asyncio.to_thread(answer, model.id, result, request.encoding_format)
