"""`/lmsp/v1/models/{id}/load` and `/unload` (issue 39): a model into or out of the worker's
memory now, answered with the model (its `state` and `loaded_bytes`)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from ..protocol.fields import Body
from ..protocol.operations import Reply
from ..protocol.registry import Model
from ..services import residency
from .base import LMSPHandler, operation


class LoadModelRequest(Body):
    keep_alive: Annotated[float, Field(allow_inf_nan=False)] | None = Field(
        None,
        description="Seconds it stays loaded once idle (0: unloaded at once when idle; "
        "negative: until evicted for room; absent: the server's keep_alive).",
    )


class ModelLoadHandler(LMSPHandler):
    @operation(
        "loadModel",
        "Load a model into the inference worker now (verified first; loaded once however many ask)",
        "models",
        access="models:write",
        replies={200: Reply("The model, `state: loaded`.", Model)},
        errors=(404, 409, 500),
    )
    async def post(self, model_id: str, body: LoadModelRequest | None) -> None:
        keep_alive = body.keep_alive if body is not None else None
        self.write_json(await residency.load_model(self.ctx, model_id, keep_alive, self.caller))


class ModelUnloadHandler(LMSPHandler):
    @operation(
        "unloadModel",
        "Unload a model from the inference worker now (409 model_busy while work on it runs)",
        "models",
        access="models:write",
        replies={200: Reply("The model, no longer `loaded`.", Model)},
        errors=(404, 409, 500),
    )
    async def post(self, model_id: str) -> None:
        self.write_json(await residency.unload_model(self.ctx, model_id, self.caller))
