"""`/lmsp/v1/service` (identity, LMSP B2) and `/lmsp/v1/models` (the OpenAI list shape, B4)."""

from __future__ import annotations

from ..protocol.errors import not_found
from .base import LMSPHandler, allow_unauthenticated, requires

CAPABILITIES = [
    "responses",
    "responses.background",
    "responses.stream",
    "tasks",
    "tasks.events",
    "resume",
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
            }
        )


class ModelsHandler(LMSPHandler):
    @allow_unauthenticated
    @requires("models:read")
    def get(self) -> None:
        self.write_json({"object": "list", "data": [m.to_wire() for m in self.ctx.catalog.list()]})


class ModelHandler(LMSPHandler):
    @allow_unauthenticated
    @requires("models:read")
    def get(self, model_id: str) -> None:
        for model in self.ctx.catalog.list():
            if model.id == model_id:
                self.write_json(model.to_wire())
                return
        raise not_found("model", model_id, param="model")
