"""The service context: the objects every service function needs, made once by the extension.

`offload` is how database work leaves the Tornado IOLoop: a transaction may wait up to the
busy timeout for SQLite's write lock, and the loop must never wait with it. Service functions
that only touch the database are plain functions (the handlers run them through `offload`);
those that also act on the loop (publishing committed events, handing a task to the runner)
are coroutines that offload their transactions and do the rest on the loop, after the commit.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import ParamSpec, TypeVar

from ..auth.ratelimit import RateLimiter
from ..engine.blas import BlasSelection
from ..protocol.errors import LMSPError
from ..store.database import Database
from ..store.errors import is_storage_full
from .admission import Admission
from .bus import EventBus
from .catalog import ModelCatalog
from .embeddings import Embedder
from .registration import ModelRegistrar
from .residency import ModelResidency
from .runner import TaskRunner
from .sealing import Sealer
from .webhook_delivery import WebhookDeliverer

# Seconds a client is told to wait when the disk is full (freeing space is the owner's act).
STORAGE_RETRY_AFTER = 30


def storage_full() -> LMSPError:
    """The answer to a request whose transaction failed for lack of disk space (issue 43)."""
    return LMSPError(
        507,
        "storage_full",
        "The server's disk is full: nothing can be stored until space is freed. Retry later.",
        type="server_error",
        headers={"Retry-After": str(STORAGE_RETRY_AFTER)},
    )


P = ParamSpec("P")
T = TypeVar("T")

# Threads for request-path database work: enough for a few transactions waiting on the lock
# while others read; more would only queue on SQLite's single writer.
DB_THREADS = 4


@dataclass
class ServiceContext:
    db: Database
    bus: EventBus
    catalog: ModelCatalog
    runner: TaskRunner
    registrar: ModelRegistrar
    service_id: str
    version: str
    max_output_tokens_default: int = 0
    # The thinking budget of a request that asks for none (None: no limit).
    max_reasoning_tokens: int | None = None
    # The summary's output limit in `POST /responses/compact` (at most a quarter of a window).
    compaction_summary_tokens: int = 1024
    # The most choices (`n`) a chat completion may ask for.
    max_choices: int = 4
    keepalive_interval: float = 15.0
    max_body_bytes: int = 1024 * 1024
    body_timeout: float = 60.0
    idempotency_ttl: float = 24 * 3600.0
    pairing_ttl: float = 600.0
    # Starting a pairing, per remote address; polling for its token, per pairing.
    pairing_limiter: RateLimiter = field(default_factory=lambda: RateLimiter(30, 10))
    poll_limiter: RateLimiter = field(default_factory=lambda: RateLimiter(30, 10))
    max_pending_pairings: int = 20
    # Context windows, output limits and per-client quotas (services.admission).
    admission: Admission = field(default_factory=Admission)
    # Who owns what a Jupyter-authenticated caller creates (LMSPExtension.owner_from).
    owner_from: str = "auto"
    # The inference worker's BLAS: chosen by probing, reported by GET /service.
    blas: BlasSelection | None = None
    # Seals what stateless clients carry between turns (compaction items).
    sealer: Sealer | None = None
    # Embeddings waiting for the inference worker (`POST /embeddings`).
    embedder: Embedder | None = None
    # The models the worker holds; `POST /models/{id}/load` and `/unload`.
    residency: ModelResidency | None = None
    # Sends the webhook outbox (issue 38); woken when the owner asks for a redelivery.
    webhooks: WebhookDeliverer | None = None
    executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(DB_THREADS, thread_name_prefix="lmsp-db")
    )

    async def offload(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """`fn(*args, **kwargs)` on a database thread, awaited from the loop."""
        loop = asyncio.get_running_loop()
        try:
            future = loop.run_in_executor(self.executor, functools.partial(fn, *args, **kwargs))
        except RuntimeError as e:
            # The executor is shut down: the server is stopping (SIGTERM) while a request came
            # in or was still on its way; a 503, not a traceback.
            raise LMSPError(
                503,
                "server_shutting_down",
                "The server is shutting down; retry when it is back.",
                type="server_error",
            ) from e
        try:
            return await future
        except Exception as e:
            if is_storage_full(e):
                raise storage_full() from e
            raise

    def close(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)
