"""The service context: the objects every service function needs, made once by the extension."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..auth.ratelimit import RateLimiter
from ..engine.blas import BlasSelection
from ..store.database import Database
from .admission import Admission
from .bus import EventBus
from .catalog import ModelCatalog
from .registration import ModelRegistrar
from .runner import TaskRunner


@dataclass
class ServiceContext:
    db: Database
    bus: EventBus
    catalog: ModelCatalog
    runner: TaskRunner
    registrar: ModelRegistrar
    service_id: str
    version: str
    max_output_tokens_default: int = 1024
    keepalive_interval: float = 15.0
    max_body_bytes: int = 1024 * 1024
    idempotency_ttl: float = 24 * 3600.0
    pairing_ttl: float = 600.0
    # Starting a pairing, per remote address; polling for its token, per pairing.
    pairing_limiter: RateLimiter = field(default_factory=lambda: RateLimiter(30, 10))
    poll_limiter: RateLimiter = field(default_factory=lambda: RateLimiter(30, 10))
    max_pending_pairings: int = 20
    # Context windows, output limits and per-client quotas (services.admission).
    admission: Admission = field(default_factory=Admission)
    # The inference worker's BLAS: chosen by probing, reported by GET /service.
    blas: BlasSelection | None = None
