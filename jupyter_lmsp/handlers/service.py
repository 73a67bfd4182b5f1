"""`/lmsp/v1/service` (identity, LMSP B2) and `/lmsp/v1/models` (the OpenAI list shape, B4)."""

from __future__ import annotations

from ..protocol.operations import Reply, ResponseHeader
from ..protocol.registry import Model, ModelDeleted, ModelList, RegisterModelRequest
from ..protocol.service import Blas, Limits, Service, WorkerInfo
from ..protocol.tasks import Task
from ..services import disclosure
from .base import LMSPHandler, operation

CAPABILITIES = [
    "responses",
    "responses.background",
    "responses.stream",
    "responses.idempotency",
    "chat.completions",
    "structured_outputs",
    "function_tools",
    "stop_sequences",
    "logprobs",
    "chat.completions.n",
    "tasks",
    "tasks.events",
    "resume",
    "models.registry",
    "pairing",
    "openapi",
]


class ServiceHandler(LMSPHandler):
    @operation(
        "getService",
        "The service's identity, capabilities and limits",
        "service",
        access="authenticated",
        replies={200: Reply("The service.", Service)},
    )
    async def get(self) -> None:
        ctx = self.ctx
        worker = dict(ctx.runner.worker_info)
        # Where the BLAS libraries are on the host is the owner's business.
        blas = disclosure.blas_report(
            ctx.blas.report() if ctx.blas is not None else None, self.caller
        )
        if not self.caller.is_owner:
            # Which process runs the models too.
            worker.pop("pid", None)
        service = Service(
            id=ctx.service_id,
            name="jupyter-lmsp",
            version=ctx.version,
            capabilities=CAPABILITIES,
            default_model=ctx.catalog.default(),
            limits=Limits(
                max_body_bytes=ctx.max_body_bytes,
                max_output_tokens_default=ctx.max_output_tokens_default,
                max_choices=ctx.max_choices,
            ),
            worker=WorkerInfo.model_validate(worker),
            blas=None if blas is None else Blas.model_validate(blas),
        )
        wire = service.wire()
        # The worker's and the BLAS's fields are there only when they apply (no pid while
        # the worker starts, no probe results while the BLAS is being chosen).
        wire["worker"] = {k: v for k, v in wire["worker"].items() if k in worker}
        if blas is not None:
            wire["blas"] = {k: v for k, v in wire["blas"].items() if k in blas}
        self.write_json(wire)


class ModelsHandler(LMSPHandler):
    @operation(
        "listModels",
        "The registered models",
        "models",
        access="models:read",
        replies={200: Reply("The models.", ModelList)},
    )
    async def get(self) -> None:
        models = await self.call(self.ctx.catalog.list, self.caller)
        self.write_json(ModelList.model_validate({"data": models}).wire())

    @operation(
        "registerModel",
        "Register a model (a task: files are downloaded from a hub, hashed, GGUF converted)",
        "models",
        access="models:write",
        replies={
            202: Reply(
                "The registration task, committed before this answer; its events are `task.*`.",
                Task,
                headers={"Location": ResponseHeader("The task's URL.", required=True)},
            )
        },
        errors=(404, 409, 429),
        idempotent=True,
    )
    async def post(self, body: RegisterModelRequest) -> None:
        task = await self.ctx.registrar.create(body, self.caller, self.ctx.offload)
        # The registration task was committed before this 202 (section 11.2).
        self.set_header("Location", f"{self.api_prefix}/tasks/{task['id']}")
        self.write_json(task, 202)


class ModelHandler(LMSPHandler):
    @operation(
        "getModel",
        "One model",
        "models",
        access="models:read",
        replies={200: Reply("The model.", Model)},
        errors=(404,),
    )
    async def get(self, model_id: str) -> None:
        self.write_json(await self.call(self.ctx.catalog.get, model_id, self.caller))

    @operation(
        "deleteModel",
        "Forget a model (files the service made itself are removed)",
        "models",
        access="models:write",
        replies={200: Reply("Deleted.", ModelDeleted)},
        errors=(404,),
    )
    async def delete(self, model_id: str) -> None:
        self.write_json(await self.call(self.ctx.catalog.delete, model_id))
