"""Prometheus metrics: every LMSP metric is defined and recorded here (docs/metrics.md).

The metrics live in `REGISTRY` (LMSP's own, served at `/lmsp/v1/metrics` to callers with the
`metrics:read` scope) and are registered in `prometheus_client`'s default registry too, which
Jupyter Server serves at `/metrics` beside its own. Both expositions are built in memory on the
IOLoop (as Jupyter Server's is), so nothing here reads the database when scraped: the gauges
that come from the database (`lmsp_tasks`) are refreshed off the loop (`refresh_from_db`, run
on a database thread by the extension every few seconds and before each `/lmsp/v1/metrics`
answer) and say so in their help text. With several servers on one database each server counts
what it did itself; only those gauges are database-wide.

Who records what: the handlers (`on_request`, idempotency, SSE, auth, pairing), the runner
(`services.runner_clock`: queue wait, time to first token, inter-token latency, end-to-end
duration, tokens, batch sizes, prompt cache, model loads, worker restarts, resumed tokens,
snapshot lag),
the runner's committer (transaction durations) and the recoveries (`recovered`). The engine
knows nothing of this: the worker reports its step and load figures in its messages
(`engine.messages.JobStarted`, `JobTokens`), which the runner hands here.

`set_enabled(False)` (`LMSPExtension.metrics = False`) makes every record a no-op, for the
benchmark that measures what metrics cost.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

from prometheus_client import REGISTRY as DEFAULT_REGISTRY
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..store import queries
from ..store.database import Database

__all__ = ["REGISTRY", "child", "enabled", "exposition", "refresh_from_db", "set_enabled"]

REGISTRY = CollectorRegistry(auto_describe=True)

_enabled = True


def set_enabled(enabled: bool) -> None:
    """Record metrics (the default) or not (every record below is then a no-op)."""
    global _enabled
    _enabled = enabled


def enabled() -> bool:
    return _enabled


# Latencies from a few milliseconds (a token on a small model) to minutes (a long generation).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# Per-token gaps: a token every 5 ms to one every 2 s.
TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2)
# Database transactions: sub-millisecond to the busy timeout.
TRANSACTION_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)
LOAD_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

_ALL: list[Counter | Gauge | Histogram] = []


def _counter(name: str, doc: str, labels: Iterable[str] = ()) -> Counter:
    metric = Counter(name, doc, list(labels), registry=REGISTRY)
    _ALL.append(metric)
    return metric


def _gauge(name: str, doc: str, labels: Iterable[str] = ()) -> Gauge:
    metric = Gauge(name, doc, list(labels), registry=REGISTRY)
    _ALL.append(metric)
    return metric


def _histogram(
    name: str, doc: str, labels: Iterable[str] = (), buckets: tuple[float, ...] = LATENCY_BUCKETS
) -> Histogram:
    metric = Histogram(name, doc, list(labels), buckets=buckets, registry=REGISTRY)
    _ALL.append(metric)
    return metric


# -- HTTP ------------------------------------------------------------------------------------

HTTP_REQUESTS = _counter(
    "lmsp_http_requests",
    "Requests to /lmsp/v1 answered by this server, by operation (its OpenAPI operationId; "
    "'unknown' for a path no operation serves), method and status code.",
    ["operation", "method", "status"],
)
HTTP_DURATION = _histogram(
    "lmsp_http_request_duration_seconds",
    "Time from a request's arrival to its answer's end (an SSE stream's whole life), by operation.",
    ["operation"],
)

# -- tasks and the queue -----------------------------------------------------------------------

TASKS_CREATED = _counter(
    "lmsp_tasks_created",
    "Tasks committed by this server, by kind (response, model registration) and model.",
    ["kind", "model"],
)
TASKS_ENDED = _counter(
    "lmsp_tasks_ended",
    "Generation tasks this server's runner ended, by model and terminal state.",
    ["model", "state"],
)
TASKS = _gauge(
    "lmsp_tasks",
    "Tasks by state, read from the database (every server on it: the same value on each), "
    "refreshed every few seconds and before each /lmsp/v1/metrics answer.",
    ["state"],
)
QUEUE_DEPTH = _gauge(
    "lmsp_queue_depth",
    "Tasks waiting in this server's runner for a decoding slot (queued, paused or adopted).",
)
ACTIVE = _gauge(
    "lmsp_active_generations",
    "Tasks holding one of this server's decoding slots (being claimed or generating).",
)
QUEUE_WAIT = _histogram(
    "lmsp_queue_wait_seconds",
    "Time a task waited in this server's runner from being queued to being handed to the "
    "inference worker, by model.",
    ["model"],
)
TTFT = _histogram(
    "lmsp_time_to_first_token_seconds",
    "Time from a task's submission to its first generated token reaching the server, by "
    "model (tasks this server created; a resumed task is not counted).",
    ["model"],
)
ITL = _histogram(
    "lmsp_inter_token_latency_seconds",
    "Time between generated tokens as the server receives them (a batch of n tokens after a "
    "gap g counts n gaps of g/n), by model.",
    ["model"],
    TOKEN_BUCKETS,
)
E2E = _histogram(
    "lmsp_task_duration_seconds",
    "Time from a task's submission to its terminal state, by model and state (tasks this "
    "server created).",
    ["model", "state"],
)
INPUT_TOKENS = _counter(
    "lmsp_input_tokens",
    "Prompt tokens of the generations started by this server's worker, by model.",
    ["model"],
)
OUTPUT_TOKENS = _counter(
    "lmsp_output_tokens",
    "Tokens generated by this server's worker, by model.",
    ["model"],
)
ACCEPTED_DRAFT_TOKENS = _counter(
    "lmsp_accepted_draft_tokens",
    "Output tokens of finished generations that speculative decoding proposed and the model "
    "verified (counted in lmsp_output_tokens too), by model.",
    ["model"],
)
BATCH_SIZE = _histogram(
    "lmsp_batch_size",
    "Sequences decoded together in one step of the inference worker.",
    buckets=BATCH_BUCKETS,
)
CACHE_LOOKUPS = _counter(
    "lmsp_prompt_cache_lookups",
    "Generations started (each looks its prompt up in the prompt cache), by model.",
    ["model"],
)
CACHE_HITS = _counter(
    "lmsp_prompt_cache_hits",
    "Generations that reused a cached prompt prefix, by model.",
    ["model"],
)
CACHE_REUSED_TOKENS = _counter(
    "lmsp_prompt_cache_reused_tokens",
    "Prompt tokens taken from the prompt cache instead of being computed, by model.",
    ["model"],
)
CACHE_REUSED_BYTES = _counter(
    "lmsp_prompt_cache_reused_bytes",
    "Bytes of key/value cache the reused prompt tokens took from the prompt cache (memory "
    "that was not computed again), by model.",
    ["model"],
)
CACHE_BYTES = _gauge(
    "lmsp_prompt_cache_bytes",
    "Memory the worker's prompt cache holds (as of the last generation started).",
)
MODEL_LOADS = _counter(
    "lmsp_model_loads",
    "Models the worker verified and loaded, by model.",
    ["model"],
)
MODEL_LOAD_SECONDS = _histogram(
    "lmsp_model_load_seconds",
    "Time the worker took to verify and load a model, by model.",
    ["model"],
    LOAD_BUCKETS,
)
WORKER_RESTARTS = _counter(
    "lmsp_worker_restarts",
    "Times this server's inference worker died unexpectedly and was started again.",
)

# -- durability ------------------------------------------------------------------------------

RECOVERED = _counter(
    "lmsp_recovered_tasks",
    "Unfinished tasks this server recovered (section 11.3), by cause (startup: its own "
    "start; sweep: another server's expired lease; worker_exit: its worker died), the state "
    "they were found in, their restart policy and the state they were left in.",
    ["cause", "previous_state", "policy", "outcome"],
)
RESUMED_TOKENS = _counter(
    "lmsp_resumed_tokens",
    "Committed output tokens fed to the worker again when a task resumed from its snapshot "
    "(after a crash or a pause): prefilled again instead of being generated, by model.",
    ["model"],
)
SNAPSHOT_LAG = _histogram(
    "lmsp_snapshot_commit_lag_seconds",
    "Time from generated tokens reaching the server to their snapshot being committed (what "
    "a crash at that moment would lose).",
    buckets=(*TOKEN_BUCKETS, 5, 10),
)
TRANSACTIONS = _histogram(
    "lmsp_runner_transaction_seconds",
    "Duration of the runner's database transactions (event appends: claims, starts, "
    "snapshots of text, ends, recoveries), by job; the _count is the number of transactions.",
    ["job"],
    TRANSACTION_BUCKETS,
)
IDEMPOTENT = _counter(
    "lmsp_idempotent_requests",
    "Requests with an Idempotency-Key, by outcome: replayed (a stored result answered), "
    "mismatch (422, the key was used with another request), conflict (409, its first request "
    "still ran), new (the request ran).",
    ["operation", "outcome"],
)
UNKEYED_RETRIES = _counter(
    "lmsp_unkeyed_retries",
    "POSTs an SDK sent again (x-stainless-retry-count > 0) without an Idempotency-Key: each "
    "may have done the same work twice.",
    ["operation"],
)
SSE_OPEN = _gauge("lmsp_sse_streams_open", "Event streams this server is sending now.")
SSE_RECONNECTS = _counter(
    "lmsp_sse_reconnects",
    "Event streams opened with Last-Event-ID (a client reconnecting).",
)
EVENTS_REPLAYED = _counter(
    "lmsp_sse_events_replayed",
    "Stored events read from the database to send on a stream (what a client missed or "
    "asked for again), as opposed to live ones.",
)

# -- auth ------------------------------------------------------------------------------------

PAIRING_REQUESTS = _counter(
    "lmsp_pairing_requests",
    "Pairing requests started (accepted for the owner to decide).",
)
PAIRING_DECISIONS = _counter(
    "lmsp_pairing_decisions",
    "Pairing requests the owner decided, by decision (approved, denied).",
    ["decision"],
)
REFUSED = _counter(
    "lmsp_refused_requests",
    "Requests refused for who sent them, by status (401, 403, 429) and reason (the error "
    "code: invalid_token, insufficient_scope, rate_limit_exceeded, ...).",
    ["status", "reason"],
)

# -- loaded models (issue 39) -------------------------------------------------------------------

MODEL_UNLOADS = _counter(
    "lmsp_model_unloads",
    "Models this server's worker unloaded, by reason: budget (room for another), idle (its "
    "keep-alive ran out), asked (POST /models/{id}/unload).",
    ["reason"],
)
MODELS_RESIDENT_BYTES = _gauge(
    "lmsp_models_resident_bytes", "Bytes of the weights of the models the worker holds."
)
MODELS_LOADED = _gauge("lmsp_models_loaded", "Models the worker holds.")


for _metric in _ALL:
    # Beside Jupyter Server's own metrics at /metrics (one registry per process).
    DEFAULT_REGISTRY.register(_metric)


def exposition() -> bytes:
    """The text exposition of the LMSP metrics (what /lmsp/v1/metrics answers)."""
    return generate_latest(REGISTRY)


# -- recording -------------------------------------------------------------------------------

_Metric = TypeVar("_Metric", Counter, Gauge, Histogram)
_children: dict[tuple[object, tuple[str, ...]], Any] = {}


def child(metric: _Metric, *values: str) -> _Metric:
    """`metric.labels(*values)`, remembered: `labels()` checks the values and takes the metric's
    lock on every call (~2.5 µs here, as much as the increment itself), on the paths every
    request and every token take."""
    key = (metric, values)
    child = _children.get(key)
    if child is None:
        child = _children[key] = metric.labels(*values)
    return child


def on_request(
    operation: str, method: str, status: int, seconds: float, reason: str | None
) -> None:
    """A request to /lmsp/v1 was answered (`reason`: the error code of a 401/403/429)."""
    if not _enabled:
        return
    child(HTTP_REQUESTS, operation, method, str(status)).inc()
    child(HTTP_DURATION, operation).observe(seconds)
    if status in (401, 403, 429):
        child(REFUSED, str(status), reason or "unknown").inc()


def idempotent(operation: str, outcome: str) -> None:
    if _enabled:
        child(IDEMPOTENT, operation, outcome).inc()


def unkeyed_retry(operation: str) -> None:
    if _enabled:
        child(UNKEYED_RETRIES, operation).inc()


def sse_opened(reconnect: bool) -> None:
    if _enabled:
        SSE_OPEN.inc()
        if reconnect:
            SSE_RECONNECTS.inc()


def sse_closed() -> None:
    if _enabled:
        SSE_OPEN.dec()


def events_replayed(n: int) -> None:
    if _enabled and n:
        EVENTS_REPLAYED.inc(n)


def task_created(kind: str, model: str) -> None:
    if _enabled:
        child(TASKS_CREATED, kind, model).inc()


def pairing_started() -> None:
    if _enabled:
        PAIRING_REQUESTS.inc()


def pairing_decided(approved: bool) -> None:
    if _enabled:
        child(PAIRING_DECISIONS, "approved" if approved else "denied").inc()


def recovered(cause: str, counts: Mapping[tuple[str, str, str], int]) -> None:
    """A recovery committed: `counts` by (previous state, policy, outcome)."""
    if not _enabled:
        return
    for (previous, policy, outcome), n in counts.items():
        child(RECOVERED, cause, previous, policy, outcome).inc(n)


def transaction(job: str, seconds: float) -> None:
    if _enabled:
        child(TRANSACTIONS, job).observe(seconds)


# -- loaded models (issue 39): recording ----------------------------------------------------------


def model_unloaded(reason: str) -> None:
    if _enabled:
        child(MODEL_UNLOADS, reason).inc()


def models_resident(nbytes: int, count: int) -> None:
    if _enabled:
        MODELS_RESIDENT_BYTES.set(nbytes)
        MODELS_LOADED.set(count)


def refresh_from_db(db: Database) -> None:
    """(database thread) Set the gauges read from the database."""
    if not _enabled:
        return
    counts = queries.count_tasks_by_state(db)
    for state in queries.TASK_STATES:
        child(TASKS, state).set(counts.get(state, 0))
