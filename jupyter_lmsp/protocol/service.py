"""The service's identity (LMSP B2): `GET /service`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .fields import WireObject, optional_on_wire


class Limits(WireObject):
    max_body_bytes: int
    max_output_tokens_default: int = Field(
        description="The output limit of a request that gives none; 0: what the model's "
        "context window leaves."
    )
    max_choices: int = Field(description="The most choices (`n`) of a chat completion.")


class WorkerInfo(WireObject):
    """The inference worker: its state, and (to the owner only) its process id."""

    model_config = {"json_schema_extra": optional_on_wire("pid", "blas", "last_exit_code")}
    state: str = Field(examples=["starting", "ready", "stopped", "restarting"])
    pid: int | None = None
    blas: str | None = None
    last_exit_code: int | None = None


class BlasCandidate(WireObject):
    """What the probe found for one BLAS candidate (times in ms)."""

    name: str
    verdict: Literal["accepted", "rejected", "skipped"]
    chosen: bool
    reason: str
    origin: str
    coretype: str | None
    decode_ms: float | None
    prefill_ms: float | None
    threads: int | None
    threads_honoured: bool | None
    config: str | None
    corename: str | None
    seconds: float | None


class BlasPaths(WireObject):
    """Where the BLAS libraries are on the host (the owner's to see only)."""

    library: str | None
    candidates: dict[str, str | None]


class Blas(WireObject):
    """The inference worker's BLAS: chosen by probing candidates for correctness and speed
    (`choosing` until then). Host paths only under `paths`, which paired clients do not see."""

    model_config = {
        "json_schema_extra": optional_on_wire(
            "name",
            "config",
            "corename",
            "threads",
            "threads_requested",
            "coretype",
            "only",
            "reason",
            "probe_seconds",
            "probed_at",
            "cached",
            "candidates",
            "paths",
        )
    }
    state: Literal["choosing", "chosen"]
    name: str | None = None
    config: str | None = None
    corename: str | None = None
    threads: int | None = None
    threads_requested: int | None = None
    coretype: str | None = None
    only: list[str] | None = None
    reason: str | None = None
    probe_seconds: float | None = None
    probed_at: str | None = None
    cached: bool | None = None
    candidates: list[BlasCandidate] | None = None
    paths: BlasPaths | None = None


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
    blas: Blas | None
