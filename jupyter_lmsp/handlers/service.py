"""`/lmsp/v1/service` (identity, LMSP B2) and `/lmsp/v1/models` (the OpenAI list shape, B4)."""

from __future__ import annotations

from ..services import disclosure
from .base import LMSPHandler, allow_unauthenticated, idempotent, requires

CAPABILITIES = [
    "responses",
    "responses.background",
    "responses.stream",
    "responses.idempotency",
    "chat.completions",
    "tasks",
    "tasks.events",
    "resume",
    "models.registry",
    "pairing",
    "openapi",
]


class ServiceHandler(LMSPHandler):
    @allow_unauthenticated
    def get(self) -> None:
        ctx = self.ctx
        self.write_json(
            {
                "object": "service",
                "id": ctx.service_id,
                "name": "jupyter-lmsp",
                "protocol": "lmsp/1.0",
                "version": ctx.version,
                "capabilities": CAPABILITIES,
                "default_model": ctx.catalog.default_model,
                "limits": {
                    "max_body_bytes": ctx.max_body_bytes,
                    "max_output_tokens_default": ctx.max_output_tokens_default,
                },
                "worker": ctx.runner.worker_info,
                "blas": disclosure.blas_report(
                    ctx.blas.report() if ctx.blas is not None else None, self.caller
                ),
            }
        )


class ModelsHandler(LMSPHandler):
    @allow_unauthenticated
    @requires("models:read")
    def get(self) -> None:
        self.write_json({"object": "list", "data": self.ctx.catalog.list(self.caller)})

    @allow_unauthenticated
    @requires("models:write")
    @idempotent
    def post(self) -> None:
        task = self.ctx.registrar.create(self.json_body(), self.caller)
        # The registration task was committed before this 202 (section 11.2).
        self.set_header("Location", f"{self.api_prefix}/tasks/{task['id']}")
        self.write_json(task, 202)


class ModelHandler(LMSPHandler):
    @allow_unauthenticated
    @requires("models:read")
    def get(self, model_id: str) -> None:
        self.write_json(self.ctx.catalog.get(model_id, self.caller))

    @allow_unauthenticated
    @requires("models:write")
    def delete(self, model_id: str) -> None:
        self.write_json(self.ctx.catalog.delete(model_id))
