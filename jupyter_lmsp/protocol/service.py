"""The service's identity (LMSP B2): `GET /service`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .fields import WireObject, optional_on_wire


class Limits(WireObject):
    max_body_bytes: int
    max_output_tokens_default: int


class WorkerInfo(WireObject):
    """The inference worker: its state, and (to the owner only) its process id."""

    model_config = {"json_schema_extra": optional_on_wire("pid", "blas", "last_exit_code")}
    state: str = Field(examples=["starting", "ready", "stopped", "restarting"])
    pid: int | None = None
    blas: str | None = None
    last_exit_code: int | None = None


class Service(WireObject):
    object: Literal["service"] = "service"
    id: str
    name: str
    protocol: Literal["lmsp/1.0"] = "lmsp/1.0"
    version: str
    capabilities: list[str]
    default_model: str | None
    limits: Limits
    worker: WorkerInfo
