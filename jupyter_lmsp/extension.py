"""The Jupyter Server extension: configuration (traitlets), start-up recovery, and wiring.

Start-up order matters: in `initialize_settings`, which runs before the server listens, the
database is opened (its schema upgraded if it is older), this server registers as a runner
with a lease, and section 11.3 recovery is committed for the runners that are gone (a server
that ran here before and died) and the tasks nobody holds; the tasks that stay unfinished
become this runner's. The task runner (and with it the inference worker process), its lease's
heartbeat and sweep, and the feed of what other servers on the same database commit start
once the event loop runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jupyter_core.paths import jupyter_data_dir
from jupyter_server.extension.application import ExtensionApp
from traitlets import (
    Bool,
    CaselessStrEnum,
    Float,
    Integer,
    List,
    TraitError,
    Unicode,
    default,
    validate,
)

from ._version import __version__
from .engine.messages import DEFAULT_SEND_INTERVAL
from .engine.speculative import (
    DEFAULT_MAX_DRAFT,
    DEFAULT_MAX_ROWS,
    MAX_DRAFT_LIMIT,
)
from .store.database import sqlite_url

if TYPE_CHECKING:
    from .engine.blas import BlasSelection
    from .engine.client import EngineClient
    from .services.loopwatch import LoopWatch
    from .store import rules

# The services, the handlers and the engine client are imported when the server starts
# (`initialize_settings`), not with this module: `jupyter lmsp` commands make an LMSPExtension
# only for its settings, and importing the rest cost each command ~0.3 s of CPU.


class LMSPExtension(ExtensionApp):
    name = "jupyter_lmsp"
    description = "LMSP 1.0: a persistent local language-model service on MLX"
    load_other_extensions = True

    data_dir = Unicode(help="Folder for the database and the model store.").tag(config=True)
    db_url = Unicode(
        help="SQLAlchemy URL of the database: SQLite (the default, a file in data_dir) or "
        "PostgreSQL through psycopg 3 (postgresql+psycopg://USER@HOST:PORT/NAME), which many "
        "servers and standalone workers (`jupyter lmsp worker`) may share."
    ).tag(config=True)
    model_dir = Unicode(help="Folder holding MLX model directories (one per model).").tag(
        config=True
    )
    default_model = Unicode("", help="Model used when a request names none.").tag(config=True)
    model_source_dirs = List(
        Unicode(),
        help="Folders paired clients may register models from, besides the model folder and "
        "the Hugging Face cache (the owner may register from anywhere).",
    ).tag(config=True)
    max_model_bytes = Integer(
        128 * 1024**3, help="Largest total size of a model's files; larger ones are refused."
    ).tag(config=True)
    registration_concurrency = Integer(
        1, help="Model registrations (conversion, hashing) that run at once; the rest queue."
    ).tag(config=True)
    retention_seconds = Float(
        7 * 24 * 3600.0, help="How long finished tasks, their events and responses are kept."
    ).tag(config=True)
    purge_interval = Float(3600.0, help="Seconds between retention purges.").tag(config=True)
    snapshot_interval = Float(
        DEFAULT_SEND_INTERVAL,
        help="Seconds generated text is coalesced (in the inference worker) before it is "
        "committed with its snapshot; a choice's first text is not held.",
    ).tag(config=True)
    max_body_bytes = Integer(
        1024 * 1024,
        help="Largest accepted request body: a larger one gets 413 before it is read (from its "
        "Content-Length, or as soon as that many bytes arrived).",
    ).tag(config=True)
    body_timeout = Float(
        60.0, help="Seconds a request body may take to arrive before the connection is dropped."
    ).tag(config=True)
    header_timeout = Float(
        30.0,
        help="Seconds the server waits for a request's headers (on a new or idle kept-alive "
        "connection) before closing it; Tornado's default is an hour, which lets half-open "
        "connections pile up. Set on the whole Jupyter server (headers arrive before any "
        "route is known); 0 leaves Jupyter's default.",
    ).tag(config=True)
    max_output_tokens_default = Integer(
        0,
        help="max_output_tokens when a request gives none; 0: what the model's context window "
        "leaves (as OpenAI does).",
    ).tag(config=True)
    max_reasoning_tokens = Integer(
        None,
        allow_none=True,
        help="The most tokens a thinking model writes inside its thinking block when a request "
        "gives no 'max_reasoning_tokens': then its end marker is forced and the answer follows. "
        "None: no limit.",
    ).tag(config=True)
    compaction_summary_tokens = Integer(
        1024,
        help="The most tokens the summary of `POST /responses/compact` may take (less where the "
        "model's window is small: at most a quarter of it).",
    ).tag(config=True)
    max_choices = Integer(
        4,
        help="Choices a chat completion may ask for ('n'); more get 400. Each choice takes a "
        "row of the batch (max_batch_size).",
    ).tag(config=True)
    max_context_tokens = Integer(
        0,
        help="Context window requests are held to (prompt and output together); 0: each "
        "model's own. A smaller one bounds the memory a single request can take.",
    ).tag(config=True)
    grammar_compile_seconds = Float(
        5.0,
        help="Seconds a request's grammar (JSON schema, tools) may take to compile with its "
        "model's tokenizer at admission; longer is a 400 naming 'compile_seconds'.",
    ).tag(config=True)
    client_max_tasks = Integer(
        64, help="Unfinished tasks a paired client may have at once; more get 429."
    ).tag(config=True)
    client_max_tokens = Integer(
        131072,
        help="Tokens a paired client may have in flight (prompt plus output limit of its "
        "unfinished tasks); more get 429.",
    ).tag(config=True)
    client_max_stored_bytes = Integer(
        256 * 1024 * 1024,
        help="Bytes of finished responses and their events a paired client may keep (with the "
        "clients it approved); at or beyond it a new task gets 403 storage_quota_exceeded. "
        "0: no limit. The owner has none.",
    ).tag(config=True)
    keepalive_interval = Float(15.0, help="Seconds of silence before an SSE keep-alive.").tag(
        config=True
    )
    engine_token_delay = Float(
        0.0,
        help="Seconds the worker waits after each token (for demos and crash tests; 0 in use).",
    ).tag(config=True)
    idempotency_ttl = Float(
        24 * 3600.0, help="Seconds an Idempotency-Key and its result are kept."
    ).tag(config=True)
    max_batch_size = Integer(
        8, help="Generations the inference worker decodes together (continuous batching)."
    ).tag(config=True)
    prompt_cache_bytes = Integer(
        1024**3, help="Memory the worker may keep KV caches of earlier prompts in (0: none)."
    ).tag(config=True)
    max_loaded_bytes = Integer(
        0,
        help="Bytes the loaded models' weights may take together (0: half the machine's "
        "memory); the least recently used idle ones are unloaded to make room.",
    ).tag(config=True)
    keep_alive = Float(
        300.0,
        help="Seconds a model stays loaded once idle (0: unloaded after each request; "
        "negative: until it is evicted for room). A request's own keep_alive overrides it.",
    ).tag(config=True)
    gather_window = Float(
        0.02,
        help="Seconds an idle worker waits for another job of a burst before its first step "
        "(requests sent together are then prefilled as one batch); never more than two of "
        "its recent decode steps, so a fast model does not wait longer than a late job "
        "would lose by joining at the next step.",
    ).tag(config=True)
    gather_limit = Float(0.15, help="Seconds an idle worker gathers a burst of jobs at most.").tag(
        config=True
    )
    speculative_decoding = Bool(
        True,
        help="Draft-free speculative decoding in the worker: tokens that repeat the job's own "
        "context (prompt, earlier turns, text so far) are proposed and verified several per "
        "step, when the worker expects that to be faster. It never changes a token: the "
        "output is exactly the output without it. False decodes one token per step.",
    ).tag(config=True)
    speculative_max_draft = Integer(
        DEFAULT_MAX_DRAFT,
        help=f"The most tokens speculative decoding proposes per generation and step "
        f"(1-{MAX_DRAFT_LIMIT}).",
    ).tag(config=True)

    speculative_max_rows = Integer(
        DEFAULT_MAX_ROWS,
        help="The most generations a worker's step may decode together and still speculate; "
        "larger batches decode one token per generation and step. Measured where verifying "
        "costs most (a 2-CPU AVX-512 EPYC, the demo model): one and four streams gained, eight "
        "lost. Raise it where verify steps of many rows are cheap (a GPU).",
    ).tag(config=True)

    speculative_learn_costs = Bool(
        True,
        help="Whether the worker learns what its forward steps cost on this machine from the "
        "steps it runs, and speculates only where that pays here. False: the built-in cost "
        "prior alone, so the same job speculates the same way on every machine (reproducible "
        "benchmarks and tests); slower where the prior does not fit the machine.",
    ).tag(config=True)

    @validate("speculative_max_draft")
    def _valid_max_draft(self, proposal: Any) -> int:
        value = int(proposal["value"])
        if not 1 <= value <= MAX_DRAFT_LIMIT:
            raise TraitError(
                f"speculative_max_draft must be between 1 and {MAX_DRAFT_LIMIT}, got {value}"
            )
        return value

    @validate("speculative_max_rows")
    def _valid_max_rows(self, proposal: Any) -> int:
        value = int(proposal["value"])
        if value < 1:
            raise TraitError(f"speculative_max_rows must be at least 1, got {value}")
        return value

    blas_threads = Integer(
        0,
        help="OpenBLAS threads in the worker (0: 1 on machines with 2 CPUs or fewer, where a "
        "second BLAS thread stalls whenever anything else runs; else OpenBLAS's default).",
    ).tag(config=True)
    pairing_ttl = Float(600.0, help="Seconds a pairing request waits for the owner.").tag(
        config=True
    )
    pairing_rate_per_minute = Float(
        30.0, help="Unauthenticated pairing requests allowed per minute and address."
    ).tag(config=True)
    pairing_burst = Integer(10, help="Unauthenticated pairing requests allowed in a burst.").tag(
        config=True
    )
    pairing_poll_rate_per_minute = Float(
        30.0, help="Polls for a pairing's token allowed per minute and pairing."
    ).tag(config=True)
    pairing_poll_burst = Integer(10, help="Polls for a pairing's token allowed in a burst.").tag(
        config=True
    )
    max_pending_pairings = Integer(
        20,
        help="Pairing requests that may wait for the owner at once; a new one beyond them "
        "ends the oldest waiting (it expires), so a flood never locks a program out.",
    ).tag(config=True)
    use_openblas = Unicode(
        "auto",
        help="'auto' gives the worker the fastest BLAS that passes the probe (an OpenBLAS on "
        "Linux when one is correct and faster than mlx's reference BLAS); 'no' never probes.",
    ).tag(config=True)
    blas_coretype = Unicode(
        "",
        help="OPENBLAS_CORETYPE for the worker and the BLAS probe, e.g. 'Haswell' to run a "
        "DYNAMIC_ARCH OpenBLAS without its AVX-512 kernels (fixed-target builds such as "
        "cmeel-openblas are then skipped). Empty: the server's environment decides.",
    ).tag(config=True)
    blas_candidates = Unicode(
        "",
        help="Probe only these BLAS candidates, comma-separated (names as GET /service lists "
        "them under blas.candidates: ngsolve-openblas, system-openblas-pthread, "
        "cmeel-openblas, ...); empty: all found. The reference BLAS is always measured.",
    ).tag(config=True)
    local_worker = Bool(
        True,
        help="Run an inference worker in this server (the default). False: this server runs "
        "no generation; the tasks it accepts wait in the database's shared queue for a "
        "standalone worker (`jupyter lmsp worker`, on a shared PostgreSQL database) to claim "
        "them, and it streams their events as the worker commits them.",
    ).tag(config=True)
    lease_seconds = Float(
        15.0,
        help="How long this server's lease on its tasks lasts without a heartbeat. Another "
        "server on the same database recovers this one's tasks once it expires (at once when "
        "it can see, on the same machine, that this server's process is gone).",
    ).tag(config=True)
    heartbeat_interval = Float(
        2.0,
        help="Seconds between heartbeats (renewing the lease), each followed by a sweep that "
        "recovers the tasks of servers that died.",
    ).tag(config=True)
    event_poll_interval = Float(
        0.02,
        help="Seconds between looks at the database for what other servers on it committed "
        "(events of tasks watched here, cancels of tasks run here), while a task is watched "
        "here or run here; an idle server on SQLite looks once a second, and at once when "
        "that changes.",
    ).tag(config=True)
    owner_from = CaselessStrEnum(
        ["auto", "identity", "server"],
        default_value="auto",
        help="Who owns what a Jupyter-authenticated caller creates. 'identity': the Jupyter "
        "identity's username (JupyterHub users); 'server': the user the server runs for "
        "($JUPYTERHUB_USER, else the OS user); 'auto': 'server' with Jupyter Server's own "
        "single-user identity providers (whose usernames are random per session), else "
        "'identity'.",
    ).tag(config=True)
    loop_watch_path = Unicode(
        "",
        help="Append the event loop's stalls to this file once a second (JSON lines: the "
        "longest gap and the 99th percentile of gaps between timer callbacks asked for every "
        "5 ms); empty: not measured. For benchmarks and diagnosis.",
    ).tag(config=True)
    metrics = Bool(
        True,
        help="Record the Prometheus metrics (served at /metrics and /lmsp/v1/metrics, "
        "docs/metrics.md). Off, every metric stays at zero (for measuring what they cost).",
    ).tag(config=True)
    metrics_interval = Float(
        5.0,
        help="Seconds between refreshes of the metrics read from the database (tasks by "
        "state), done off the event loop; /lmsp/v1/metrics refreshes them for its answer.",
    ).tag(config=True)
    webhook_max_attempts = Integer(
        10,
        help="Attempts at delivering one webhook event before it becomes a dead letter "
        "(listed by GET /lmsp/v1/webhooks/{id}/deliveries?status=dead; the owner may redeliver).",
    ).tag(config=True)
    webhook_backoff = Float(
        5.0,
        help="Seconds between a webhook's first failed attempt and the next; each later wait "
        "doubles, up to webhook_backoff_max.",
    ).tag(config=True)
    webhook_backoff_max = Float(3600.0, help="The longest wait between webhook attempts.").tag(
        config=True
    )
    webhook_timeout = Float(
        10.0,
        help="Seconds a webhook attempt waits to connect, and then for each read of the answer.",
    ).tag(config=True)
    webhook_concurrency = Integer(4, help="Webhook deliveries sent at once by this server.").tag(
        config=True
    )
    webhook_endpoint_concurrency = Integer(
        2,
        help="Webhook deliveries sent at once to any one endpoint (kept below "
        "webhook_concurrency, so a slow receiver never takes every sender).",
    ).tag(config=True)
    webhook_poll_interval = Float(
        1.0,
        help="Seconds between looks for webhook deliveries due (other servers' included).",
    ).tag(config=True)
    freeze_startup_heap = Bool(
        True,
        help="Once the server has started, take the objects alive then out of the garbage "
        "collector's scans (gc.freeze): a Jupyter server starts with ~250k objects, and each "
        "full collection of them stalled every request and event stream for ~150 ms.",
    ).tag(config=True)

    @default("data_dir")
    def _default_data_dir(self) -> str:
        return str(Path(jupyter_data_dir()) / "lmsp")

    @default("db_url")
    def _default_db_url(self) -> str:
        return sqlite_url(Path(self.data_dir) / "lmsp.sqlite")

    @default("model_dir")
    def _default_model_dir(self) -> str:
        return str(Path(self.data_dir) / "models")

    def initialize_settings(self) -> None:
        from .auth.identity import server_owner
        from .auth.ratelimit import RateLimiter
        from .handlers.logs import quiet_debug
        from .services import metrics
        from .services.admission import Admission
        from .services.bus import EventBus
        from .services.catalog import ModelCatalog
        from .services.context import ServiceContext
        from .services.embeddings import Embedder
        from .services.feed import EventFeed
        from .services.grammar_gate import GrammarGate
        from .services.lease import RunnerLease
        from .services.registration import ModelRegistrar
        from .services.residency import ModelResidency
        from .services.runner import TaskRunner
        from .services.sealing import Sealer
        from .services.webhook_delivery import DeliverySettings, WebhookDeliverer
        from .store import Database, queries
        from .store.private import private_folder

        if self.serverapp is not None:
            quiet_debug(self.serverapp.log)
        # Other local users must not read the database or the models (docs/security.md).
        private_folder(self.data_dir)
        metrics.set_enabled(self.metrics)
        self.db = Database(self.db_url, legacy_owner=server_owner())
        if self.db.schema.upgraded_from is not None:
            self.log.warning(
                "LMSP: database upgraded from schema revision %s to %s (the copy taken before: %s)",
                self.db.schema.upgraded_from,
                self.db.schema.status.revision,
                self.db.schema.backup,
            )
        self.lease = RunnerLease(
            self.db,
            lease_seconds=self.lease_seconds,
            heartbeat_interval=self.heartbeat_interval,
            label=f"jupyter-lmsp {__version__}",
            adopts=self.local_worker,
        )
        runner_id = self.lease.register()
        report = self.lease.recover()
        metrics.recovered("startup", report.by_policy)
        for dead, why in report.runners:
            self.log.info("LMSP recovery: tasks of %s (%s)", dead or "no runner", why)
        if report.released_claims:
            self.log.info(
                "LMSP recovery: released %d idempotency key(s) whose requests died before "
                "committing any work",
                report.released_claims,
            )
        if report.examined:
            self.log.info(
                "LMSP recovery: %d unfinished task(s) examined: %s",
                report.examined,
                ", ".join(f"{k} x{v}" for k, v in sorted(report.transitions.items())),
            )
        catalog = ModelCatalog(
            self.db, Path(self.model_dir), self.default_model or None, self.max_model_bytes
        )
        for model_id in catalog.sync_model_dir():
            self.log.info("LMSP: registered model directory %s", model_id)
        # Chosen on first use, on the engine client's spawner thread (never on the IOLoop).
        self.blas = self.blas_selection()
        bus = EventBus()
        runner = TaskRunner(
            self.db,
            bus,
            catalog,
            self._make_engine,
            max_active=self.max_batch_size,
            runner_id=runner_id,
            executes=self.local_worker,
        )
        admission = Admission(
            max_output_tokens_default=self.max_output_tokens_default,
            max_context_tokens=self.max_context_tokens,
            max_tasks=self.client_max_tasks,
            max_tokens=self.client_max_tokens,
            max_stored=self.client_max_stored_bytes,
            grammars=GrammarGate(deadline=self.grammar_compile_seconds),
        )
        registrar = ModelRegistrar(
            self.db,
            bus,
            catalog,
            admission=admission,
            allowed_dirs=[Path(d).expanduser() for d in self.model_source_dirs],
            max_model_bytes=self.max_model_bytes,
            concurrency=self.registration_concurrency,
            runner_id=lambda: runner.runner_id,
        )
        runner.cancel_listeners.append(registrar.kill)
        # What the worker holds (GET /models shows it).
        residency = ModelResidency(runner)
        catalog.residency = residency.loaded_bytes
        self.feed = EventFeed(self.db, bus, runner, interval=self.event_poll_interval)
        # Whoever starts the runner (the server's start, or the first request) starts these.
        runner.start_listeners.append(self._start_background)
        self.ctx = ServiceContext(
            db=self.db,
            bus=bus,
            catalog=catalog,
            runner=runner,
            registrar=registrar,
            service_id=queries.service_identity(self.db),
            sealer=Sealer(queries.sealing_key(self.db)),
            version=__version__,
            max_output_tokens_default=self.max_output_tokens_default,
            max_reasoning_tokens=self.max_reasoning_tokens,
            max_choices=max(1, self.max_choices),
            compaction_summary_tokens=max(1, self.compaction_summary_tokens),
            keepalive_interval=self.keepalive_interval,
            max_body_bytes=self.max_body_bytes,
            body_timeout=self.body_timeout,
            idempotency_ttl=self.idempotency_ttl,
            pairing_ttl=self.pairing_ttl,
            pairing_limiter=RateLimiter(self.pairing_rate_per_minute, self.pairing_burst),
            poll_limiter=RateLimiter(
                self.pairing_poll_rate_per_minute,
                self.pairing_poll_burst,
                "Too many polls for this pairing; poll every 'interval' seconds.",
            ),
            max_pending_pairings=self.max_pending_pairings,
            admission=admission,
            owner_from=self.owner_from,
            blas=self.blas,
            embedder=Embedder(runner),
            residency=residency,
        )
        self.ctx.webhooks = WebhookDeliverer(
            self.db,
            lambda: runner.runner_id,
            DeliverySettings(
                max_attempts=max(1, self.webhook_max_attempts),
                backoff_initial=self.webhook_backoff,
                backoff_max=self.webhook_backoff_max,
                timeout=self.webhook_timeout,
                concurrency=max(1, self.webhook_concurrency),
                per_endpoint=max(1, self.webhook_endpoint_concurrency),
                poll_interval=self.webhook_poll_interval,
            ),
            user_agent=f"jupyter-lmsp/{__version__}",
        )
        self._purge_task: asyncio.Task[None] | None = None
        self._metrics_task: asyncio.Task[None] | None = None
        self.loop_watch: LoopWatch | None = None

    def initialize_handlers(self) -> None:
        from .handlers.routes import routes

        self.handlers.extend(routes(self.ctx))

    async def _start_jupyter_server_extension(self, serverapp: Any) -> None:
        from .protocol.errors import LMSPError

        self._limit_header_wait(serverapp)
        self.ctx.runner.start()
        # The default model's tokenizer, for counting prompts (loaded off the loop).
        with contextlib.suppress(LMSPError):
            self.ctx.admission.warm(self.ctx.catalog.resolve(None))
        if not self.ctx.registrar.started:
            self.ctx.registrar.start()
        if self.freeze_startup_heap:
            # On the loop's next turn: after the other extensions' start-up work, too.
            asyncio.get_running_loop().call_soon(self._freeze_heap)

    def _limit_header_wait(self, serverapp: Any) -> None:
        # Jupyter makes its HTTPServer without `idle_connection_timeout`, so a connection that
        # never completes its headers is kept for Tornado's default hour; the parameters are
        # read for each new connection.
        server = getattr(serverapp, "http_server", None)
        params = getattr(server, "conn_params", None)
        if self.header_timeout > 0 and params is not None:
            params.header_timeout = self.header_timeout

    def _freeze_heap(self) -> None:
        # Collected first, so no start-up garbage is frozen (it could never be freed after).
        gc.collect()
        gc.freeze()
        self.log.info("LMSP: %d start-up objects frozen out of GC scans", gc.get_freeze_count())

    def _start_background(self, loop: asyncio.AbstractEventLoop) -> None:
        from .services.loopwatch import LoopWatch

        self.lease.start(loop, self._recovered, self.ctx.runner.lease_lost)
        self.feed.start(loop)
        if self.ctx.webhooks is not None:
            self.ctx.webhooks.start()
        if self.loop_watch_path:
            self.loop_watch = LoopWatch(self.loop_watch_path)
            self.loop_watch.start(loop)
        self._purge_task = loop.create_task(self._purge_periodically())
        if self.metrics:
            self._metrics_task = loop.create_task(self._refresh_metrics_periodically())

    def _recovered(self, report: rules.RecoveryReport) -> None:
        """A sweep recovered a dead runner's tasks: this server runs those it adopted."""
        self.ctx.runner.recovered(report)
        self.ctx.registrar.pick_up()

    async def stop_extension(self) -> None:
        if self._purge_task is not None:
            self._purge_task.cancel()
        if self._metrics_task is not None:
            self._metrics_task.cancel()
        if self.loop_watch is not None:
            self.loop_watch.stop()
        self.feed.stop()
        if self.ctx.webhooks is not None:
            await asyncio.to_thread(self.ctx.webhooks.stop)
        self.lease.stop(unregister=False)
        self.ctx.runner.stop()
        self.ctx.admission.close()
        self.ctx.close()
        # Last: once the lease is given up, any other server may take the unfinished tasks.
        self.lease.stop(unregister=True)
        self.db.dispose()

    def blas_selection(self) -> BlasSelection:
        """The inference worker's BLAS, chosen on first use (`jupyter lmsp worker` too)."""
        from .engine.blas import BlasSelection

        return BlasSelection(
            enabled=self.use_openblas != "no",
            log=self.log,
            threads=self._blas_threads(),
            coretype=self.blas_coretype,
            only=[name.strip() for name in self.blas_candidates.split(",") if name.strip()],
        )

    def _blas_threads(self) -> int:
        return self.blas_threads or (1 if (os.cpu_count() or 1) <= 2 else 0)

    def make_engine(self, on_message: Any) -> EngineClient:
        """An inference engine client with this configuration (needs `self.blas`)."""
        return self._make_engine(on_message)

    def _make_engine(self, on_message: Any) -> EngineClient:
        from .engine.client import EngineClient
        from .engine.messages import WorkerSettings
        from .engine.speculative import SpeculationSettings

        env = {}
        threads = self._blas_threads()
        if threads:
            env["OPENBLAS_NUM_THREADS"] = str(threads)
        if self.blas_coretype:
            env["OPENBLAS_CORETYPE"] = self.blas_coretype
        settings = WorkerSettings(
            max_batch_size=max(1, self.max_batch_size),
            prompt_cache_bytes=max(0, self.prompt_cache_bytes),
            gather_window=self.gather_window,
            gather_limit=self.gather_limit,
            max_loaded_bytes=max(0, self.max_loaded_bytes),
            keep_alive=self.keep_alive,
            send_interval=max(0.0, self.snapshot_interval),
            speculation=SpeculationSettings(
                enabled=self.speculative_decoding,
                max_draft=self.speculative_max_draft,
                max_rows=self.speculative_max_rows,
                learn_costs=self.speculative_learn_costs,
            ),
        )
        try:
            # The runner makes its engine on its loop: the worker's messages are read there.
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None  # made elsewhere: a reader thread hands them over
        return EngineClient(
            on_message,
            token_delay=self.engine_token_delay,
            settings=settings,
            env=env,
            prepare_env=self.blas.worker_env,
            log=self.log,
            loop=loop,
        )

    async def _refresh_metrics_periodically(self) -> None:
        from .services import metrics

        while True:
            # Off the loop: a read that may wait behind another server's checkpoint.
            try:
                await asyncio.to_thread(metrics.refresh_from_db, self.db)
            except Exception:  # a failed refresh leaves the last values; the next one retries
                self.log.warning("LMSP: could not refresh the metrics", exc_info=True)
            await asyncio.sleep(self.metrics_interval)

    async def _purge_periodically(self) -> None:
        from .store import rules, webhooks

        while True:
            # Off the loop: the purge is one write transaction, which may wait for another
            # server's write lock and may delete many rows.
            report = await asyncio.to_thread(rules.purge_expired, self.db, self.retention_seconds)
            # Delivered webhooks too (pending and dead ones stay, docs/protocol.md "Webhooks").
            await asyncio.to_thread(
                webhooks.purge_delivered, self.db, time.time() - self.retention_seconds
            )
            if report.tasks or report.idempotency_keys:
                self.log.info(
                    "LMSP retention: purged %d task(s), %d event(s), %d response(s), %d key(s)",
                    report.tasks,
                    report.events,
                    report.responses,
                    report.idempotency_keys,
                )
            await asyncio.sleep(self.purge_interval)
