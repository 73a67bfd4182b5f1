"""The inference worker process: loads MLX models and generates tokens for `GenerateJob`s.

`worker_main` is the entry point of a process started with the multiprocessing *spawn* context
(see `client.EngineClient`). It talks to the server process only through the pipe, in the
messages of `messages`. Generation runs here rather than in a thread of the server because
building each step's graph holds the GIL, which stalls the server's event loop.

Layout:
- `Worker` is the loop and the message handling: a FIFO of jobs admitted while their choices
  fit in `max_batch_size` rows, the pipe drained between scheduler steps so new jobs join and
  cancels act within one decode step (or one prefill chunk). This is the one stage that
  coalesces tokens: the steps' tokens go out together (one `StepTokens` for all the rows that
  have any) once the oldest of them has waited `send_interval` (the extension's
  `snapshot_interval`), a choice's first text at once, a choice's last tokens before its end,
  and everything before the worker waits idle; the server's runner commits each message as it
  comes. A cancel that cancels every job of the step in flight stops it part-way, at the next
  checkpoint between the model's layers (`interrupt`).
- A job's prompt is its messages through the model's chat template, with its tools rendered
  in (`toolcalls.render`), and its grammar comes from `grammars.build_grammar`.
- Generation itself is `batching.BatchScheduler` (continuous batching over mlx-lm's
  `BatchGenerator`, per-choice samplers, stop sequences, grammars and log-probabilities) with
  a `prompt_cache.PromptCache` of KV caches.
- Models are verified and loaded by `loader.ModelLoader` in a thread of their own: a job whose
  model is not in memory waits for it while the other jobs go on decoding, and a cancel of
  the last job waiting for a model stops that model's verification.

Configuration: the `WorkerSettings` given to `worker_main` (from the extension's traits:
`max_batch_size`, `prompt_cache_bytes`, `gather_window`, `gather_limit`, `snapshot_interval`
as `send_interval`, ...), nothing else.

This module imports MLX only inside the worker process (in `worker_main` and the functions it
calls), so the server process can import it to name the process target without loading MLX.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import multiprocessing.connection
import os
import pickle
import signal
import sys
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jupyter_lmsp.engine.batching import (
    DEFAULT_MAX_BATCH_SIZE,
    DEFAULT_PREFILL_STEP,
    BatchScheduler,
    Update,
)
from jupyter_lmsp.engine.chat_prompt import JobError, encode_chat
from jupyter_lmsp.engine.device import on_gpu
from jupyter_lmsp.engine.embedding import (
    CHUNK_POSITIONS_BUSY,
    CHUNK_POSITIONS_IDLE,
    EmbeddingError,
    EmbeddingQueue,
    EmbeddingSpec,
)
from jupyter_lmsp.engine.grammar_prep import MatcherBuilder
from jupyter_lmsp.engine.grammars import (
    GENERIC,
    CallFormat,
    GrammarError,
    ToolSpec,
    build_grammar,
)
from jupyter_lmsp.engine.harmony import HARMONY_MARKERS, harmony_format, is_harmony
from jupyter_lmsp.engine.interrupt import Checkpoints, StepAbandoned, install_checkpoints
from jupyter_lmsp.engine.loader import LoadResult, ModelLoader
from jupyter_lmsp.engine.messages import (
    DEFAULT_SEND_INTERVAL,
    MAX_STOP_SEQUENCES,
    MAX_TOP_LOGPROBS,
    CancelJob,
    ChoiceFinished,
    ChoiceResult,
    EmbedJob,
    EmbedResult,
    GenerateJob,
    JobCancelled,
    JobComing,
    JobFailed,
    JobFinished,
    JobStarted,
    JobTokens,
    LoadModel,
    ModelLoaded,
    ModelUnloaded,
    Shutdown,
    SlotsWanted,
    StepTokens,
    TokenLogprob,
    UnloadModel,
    WorkerReady,
    WorkerSettings,
)
from jupyter_lmsp.engine.penalties import PENALTY_LIMIT
from jupyter_lmsp.engine.prefill import DEFAULT_BREAK_EVEN
from jupyter_lmsp.engine.prompt_cache import DEFAULT_PROMPT_CACHE_BYTES, PromptCache
from jupyter_lmsp.engine.reasoning import after_thinking, effort_args
from jupyter_lmsp.engine.residency import Residency, model_bytes
from jupyter_lmsp.engine.speculative import SpeculationSettings
from jupyter_lmsp.engine.thinking import ReasoningCounter, Thinking

if TYPE_CHECKING:
    import mlx.nn as nn
    from mlx_lm.tokenizer_utils import TokenizerWrapper

log = logging.getLogger(__name__)

# How often an idle worker wakes up to check that its parent is still alive.
IDLE_POLL_SECONDS = 0.5
# When an idle worker gets a job, it waits for more before its first step: requests sent
# together (a notebook cell starting several, a client's burst) then have their prompts
# prefilled as one batch, instead of the first one's prefill holding up all the others'. It
# waits while jobs announced by `JobComing` have not arrived, and until no job has come for
# GATHER_WINDOW (or twice the longest gap between the jobs so far, if longer); at most
# GATHER_LIMIT in all. The server announces each task as it accepts it but sends its job only
# once `loading` is committed, after the burst's other requests are handled: a burst of 8
# reaches the worker spread over 30-150 ms on 2 busy cores, at a pace that depends on the load.
# Nor does it wait for a job that has not been announced longer than GATHER_STEPS of its
# recent decode steps (the fastest of the last STEP_HISTORY): a job that misses the gathering
# joins the batch at the next step, so waiting longer than a step or two to save it that step
# costs every job more than it saves. On a model that decodes in 2 ms a step, the 20 ms window
# alone added ~15 ms to every lone request's first token (issue 42); on the demo model on a
# CPU (~100 ms a step) the window is unchanged.
GATHER_WINDOW = 0.02
GATHER_LIMIT = 0.15
GATHER_STEPS = 2.0
STEP_HISTORY = 16
# Passes of at least this many positions per row (prefill chunks, long verify steps) are
# always checked part-way for cancels (`interrupt`): they are long, and evaluating them in
# sections costs them next to nothing. Shorter ones (decode steps) are checked only when a
# cancel could hand the slot to a waiting job (`Worker._checkpoints_for_step`).
CHECK_ALWAYS_FROM = 16

_PR_SET_PDEATHSIG = 1


class _ParentGone(Exception):
    """The server process is gone: the pipe hit EOF or our parent pid changed."""


def reasoning_args(tokenizer: TokenizerWrapper, effort: str | None) -> dict[str, Any]:
    """The chat template's arguments for a reasoning effort (`reasoning.effort_args`); an
    effort the model cannot take fails the job with `unsupported_reasoning_effort`."""
    try:
        return effort_args(tokenizer, effort)
    except ValueError as exc:
        raise JobError("unsupported_reasoning_effort", str(exc)) from exc


def call_format_of(
    tokenizer: TokenizerWrapper, ll_tokenizer: Any, tools: ToolSpec | None = None
) -> CallFormat:
    """The tool-call format of a model: its own where mlx-lm has a parser for it (the
    `tool_parser_type` its tokenizer config names or mlx-lm inferred) and this service a
    grammar (`toolcalls.NATIVE_FORMATS`, `callformats.FAMILIES`), else the generic one; a job
    with custom tools in a format that has no place for them gets the generic one."""
    from jupyter_lmsp.engine.callformats import FAMILIES, family_name
    from jupyter_lmsp.engine.toolcalls import NATIVE_FORMATS, call_format_for

    if is_harmony(tokenizer):
        # gpt-oss (mlx-lm names no parser for it): its markers are its special tokens.
        ids = []
        for marker in HARMONY_MARKERS:
            found = ll_tokenizer.tokenize_str(marker, parse_special=True)
            if len(found) == 1 and ll_tokenizer.is_special_token(found[0]):
                ids.append((marker, int(found[0])))
        return harmony_format(tuple(ids))
    parser = (getattr(tokenizer, "init_kwargs", None) or {}).get("tool_parser_type")
    if parser in FAMILIES:
        parser = family_name(parser, getattr(tokenizer, "chat_template", None))
        ids = []
        for marker in FAMILIES[parser].markers:
            found = ll_tokenizer.tokenize_str(marker, parse_special=True)
            if len(found) == 1 and ll_tokenizer.is_special_token(found[0]):
                ids.append((marker, int(found[0])))
        return call_format_for(parser, marker_ids=tuple(ids), tools=tools)
    if parser not in NATIVE_FORMATS:
        return GENERIC
    special = True
    for marker in (GENERIC.start, GENERIC.end):
        ids = ll_tokenizer.tokenize_str(marker, parse_special=True)
        special = special and len(ids) == 1 and ll_tokenizer.is_special_token(ids[0])
    return call_format_for(parser, special_markers=special)


def _counter(thinking: Thinking | None, resumed: list[int]) -> ReasoningCounter | None:
    """A choice's reasoning counter, fed the tokens it resumes from."""
    if thinking is None:
        return None
    counter = ReasoningCounter(thinking)
    counter.feed(resumed)
    return counter


@dataclass
class _Outbox:
    """A running choice's tokens of the step in flight, not yet sent (one JobTokens)."""

    job_id: str
    choice: int
    # Tokens generated so far, resumed ones included: the count final messages report.
    output_tokens: int
    want_logprobs: bool = False
    # Of the tokens generated here, those speculative decoding proposed and verified.
    accepted_draft_tokens: int = 0
    # A thinking model's count of the choice's reasoning tokens (resumed ones included).
    reasoning: ReasoningCounter | None = None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # Whether any of its text went out yet (its first text is not held: `Worker._send_due`).
    sent_text: bool = False

    @property
    def pending(self) -> bool:
        return bool(self.token_ids or self.text)

    def add(self, update: Update) -> None:
        self.token_ids.extend(update.token_ids)
        self.text += update.text
        self.logprobs.extend(update.logprobs or [])
        self.output_tokens += len(update.token_ids)
        self.accepted_draft_tokens += update.drafted
        if self.reasoning is not None:
            self.reasoning.feed(update.token_ids)

    @property
    def reasoning_tokens(self) -> int:
        return self.reasoning.count if self.reasoning is not None else 0

    def take(self) -> JobTokens | None:
        if not self.pending:
            return None
        message = JobTokens(
            self.job_id,
            self.token_ids,
            self.text,
            choice=self.choice,
            logprobs=self.logprobs if self.want_logprobs else None,
        )
        self.sent_text = self.sent_text or bool(self.text)
        self.token_ids, self.text, self.logprobs = [], "", []
        return message


@dataclass
class _Prepared:
    """A job's prompt and grammar, prepared once: `grammar` is llguidance's text until the
    job's matcher is built beside the decode loop (`grammar_prep`), then that matcher."""

    prompt_ids: list[int]
    thinking: Thinking | None
    call_format: CallFormat
    calls: bool
    grammar: Any


@dataclass
class _Running:
    """A running job as the worker reports it: one outbox per choice, the choices ended."""

    job_id: str
    input_tokens: int
    outboxes: list[_Outbox]
    results: dict[int, ChoiceResult] = field(default_factory=dict)


class Worker:
    """The worker's main loop: admits jobs into a `BatchScheduler` and steps it.

    Jobs wait in a FIFO until fewer than `max_batch_size` are running, then join the batch.
    Between two scheduler steps the pipe is drained, so a new job joins and a cancel acts
    within one decode step (or one prefill chunk). The steps' tokens are held until the oldest
    has waited `send_interval` seconds, then go out in one `StepTokens` (`_send_due`); the
    server commits each such message as it comes (`services.output`).
    """

    def __init__(
        self,
        conn: Connection,
        token_delay: float = 0.0,
        parent_pid: int | None = None,
        *,
        max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
        prompt_cache_bytes: int = DEFAULT_PROMPT_CACHE_BYTES,
        prefill_step: int = DEFAULT_PREFILL_STEP,
        gather_window: float = GATHER_WINDOW,
        gather_limit: float = GATHER_LIMIT,
        gather_steps: float = GATHER_STEPS,
        speculation: SpeculationSettings | None = None,
        residency: Residency | None = None,
        prefill_break_even: int = DEFAULT_BREAK_EVEN,
        prefill_pacing: bool = True,
        send_interval: float = DEFAULT_SEND_INTERVAL,
    ) -> None:
        self._conn = conn
        # How long generated tokens may wait here before they go out (`_send_due`).
        self._send_interval = send_interval
        # When the oldest token not yet sent was generated (monotonic), and whether a
        # choice's first text is waiting (it goes at once).
        self._held_since: float | None = None
        self._first_text = False
        # Which models stay loaded: the memory budget and idle unload (`residency`).
        self._residency = residency or Residency()
        self._gather_window = gather_window
        self._gather_limit = max(gather_limit, gather_window)
        # The wall time of the last decode steps (seconds): the gather window is at most
        # `gather_steps` of the fastest (0: unbounded).
        self._gather_steps = gather_steps
        self._step_seconds: deque[float] = deque(maxlen=STEP_HISTORY)
        self._token_delay = token_delay
        self._parent_pid = parent_pid
        self._queue: deque[GenerateJob] = deque()
        # Jobs announced (JobComing) and not yet sent, with when the announcement came.
        self._coming: dict[str, float] = {}
        self._models: OrderedDict[tuple[Any, ...], tuple[nn.Module, TokenizerWrapper]] = (
            OrderedDict()
        )
        self._scheduler = BatchScheduler(
            PromptCache(prompt_cache_bytes),
            max_batch_size=max_batch_size,
            prefill_step=prefill_step,
            speculation=speculation,
            prefill_break_even=prefill_break_even,
            prefill_pacing=prefill_pacing,
        )
        self._running: dict[str, _Running] = {}
        self._shutdown = False
        self._loader = ModelLoader()
        # Grammars compiled beside the decode loop: the jobs waiting for their matcher, and
        # what was prepared for them (`_start`).
        self._matchers = MatcherBuilder()
        self._compiling: dict[str, GenerateJob] = {}
        self._prepared: dict[str, _Prepared] = {}
        # Jobs waiting for their model to be verified and loaded, by model key.
        self._waiting: dict[tuple[Any, ...], list[GenerateJob | EmbedJob | LoadModel]] = {}
        # Embedding jobs' inputs, computed a chunk at a time between decode steps (`embedding`).
        self._embeds = EmbeddingQueue()
        self._embed_specs: dict[tuple[Any, ...], EmbeddingSpec] = {}
        # For the server's metrics: when each model's load was asked for, how long the loads
        # that finished took (reported with the next job started on the model), and the batch
        # size of each step not yet reported (sent with the next JobTokens).
        self._load_asked: dict[tuple[Any, ...], float] = {}
        self._load_took: dict[tuple[Any, ...], float] = {}
        self._step_sizes: list[int] = []
        # Messages read at a checkpoint inside a step (`interrupt`), handled after it.
        self._inbox: deque[object] = deque()
        self._checkpoints = Checkpoints()
        # Tasks waiting in the server's queue for a row (`SlotsWanted`).
        self._slots_wanted = 0
        self.abandoned_steps = 0

    # --- pipe ------------------------------------------------------------------------------

    def _send(self, message: object) -> None:
        if self._step_sizes and isinstance(message, JobTokens | StepTokens):
            first = message.rows[0] if isinstance(message, StepTokens) else message
            first.batch_sizes, self._step_sizes = self._step_sizes, []
        try:
            # Plain pickle, not `Connection.send`'s ForkingPickler: the messages hold no
            # handles, and a ForkingPickler copies its dispatch table on every construction
            # (~5% of the worker's Python per decode step, py-spy, issue 42). The reader's
            # `recv` unpickles either.
            self._conn.send_bytes(pickle.dumps(message, pickle.HIGHEST_PROTOCOL))
        except (OSError, EOFError) as exc:
            raise _ParentGone from exc

    def _pump(self, timeout: float = 0.0) -> None:
        """Handle every message already in the pipe, waiting up to `timeout` for the first.

        Called only between scheduler steps: a cancel removes its job from the batch at once.
        The messages read at checkpoints during the last step come first.
        """
        if self._inbox:
            timeout = 0.0
            while self._inbox:
                self._handle(self._inbox.popleft())
        try:
            woken = multiprocessing.connection.wait(
                [self._conn, self._loader.wake_fd, self._matchers.wake_fd], timeout
            )
            if self._loader.wake_fd in woken:
                self._take_loads()
            if self._matchers.wake_fd in woken:
                self._take_matchers()
            ready = self._conn.poll(0)
            while ready:
                self._handle(self._conn.recv())
                ready = self._conn.poll(0)
        except (OSError, EOFError) as exc:
            raise _ParentGone from exc
        if self._parent_pid is not None and os.getppid() != self._parent_pid:
            raise _ParentGone

    def _handle(self, message: object) -> None:
        if isinstance(message, GenerateJob):
            self._coming.pop(message.job_id, None)
            self._queue.append(message)
        elif isinstance(message, EmbedJob):
            self._embed_job(message)
        elif isinstance(message, LoadModel):
            self._load_model(message)
        elif isinstance(message, UnloadModel):
            self._unload_model(message)
        elif isinstance(message, JobComing):
            self._coming[message.job_id] = time.monotonic()
        elif isinstance(message, CancelJob):
            self._coming.pop(message.job_id, None)
            self._cancel(message.job_id)
        elif isinstance(message, Shutdown):
            self._shutdown = True
        elif isinstance(message, SlotsWanted):
            self._slots_wanted = message.count
        else:
            log.warning("worker ignores unexpected message %r", message)

    def _cancel(self, job_id: str) -> None:
        if self._embeds.cancel(job_id):
            return  # dropped silently (`EmbedJob`)
        generated = self._scheduler.cancel(job_id)
        if generated is not None:
            self._end_cancelled(job_id, generated)
            return
        for job in self._queue:
            if job.job_id == job_id:
                self._queue.remove(job)
                self._send(JobCancelled(job.job_id, _resumed_tokens(job)))
                return
        for key, jobs in list(self._waiting.items()):
            for held in jobs:
                if held.job_id == job_id:
                    jobs.remove(held)
                    if not jobs:
                        # Nobody waits for this model any more: stop verifying it.
                        del self._waiting[key]
                        self._loader.cancel(key)
                    if isinstance(held, GenerateJob):
                        self._send(JobCancelled(held.job_id, _resumed_tokens(held)))
                    return
        compiling = self._compiling.pop(job_id, None)
        if compiling is not None:
            self._prepared.pop(job_id, None)
            self._matchers.forget(job_id)
            self._send(JobCancelled(job_id, _resumed_tokens(compiling)))
            return
        # Unknown id: the job already ended and its final message is on its way.

    def _abandon_requested(self) -> bool:
        """Asked at a checkpoint inside a step: read the messages that came (they wait in the
        inbox until the step is over) and abandon the step if they cancel every job the
        scheduler holds, or shut the worker down. Abandoning then wastes no job's work."""
        try:
            while self._conn.poll(0):
                self._inbox.append(self._conn.recv())
        except (OSError, EOFError):
            return False  # the next `_pump` finds the parent gone
        cancelled = set()
        for message in self._inbox:
            if isinstance(message, Shutdown):
                return True
            if isinstance(message, CancelJob):
                cancelled.add(message.job_id)
        running = self._scheduler.job_ids()
        return bool(running) and cancelled.issuperset(running)

    def _checkpoints_for_step(self) -> None:
        """Say which passes of the next step are checked part-way for cancels (`interrupt`).

        Long passes always are. A decode step is checked when a cancel could hand its slot to
        a job waiting for one, i.e. a job waits (in this worker's queue, or in the server's:
        `SlotsWanted`) and the batch holds one job (a cancel frees the batch then), and only
        on the CPU: there a step takes ~150-200 ms even for the demo model; a GPU's are
        short, and evaluating them in sections would stop the next step's graph from being
        built while the GPU computes.
        """
        waiting = bool(self._queue) or self._slots_wanted > 0
        decode_too = waiting and len(self._scheduler.job_ids()) == 1 and not on_gpu()
        self._checkpoints.min_positions = 1 if decode_too else CHECK_ALWAYS_FROM
        self._checkpoints.ask = self._abandon_requested

    def _abandon_step(self) -> None:
        """The step was abandoned part-way: its jobs are cancelled (their tokens so far go
        out first), then the messages read during it are handled."""
        self.abandoned_steps += 1
        for job_id, generated in self._scheduler.abandon():
            self._end_cancelled(job_id, generated)
        self._pump()

    def _end_cancelled(self, job_id: str, generated: int) -> None:
        """A running job left the scheduler cancelled: its tokens so far go out, then
        `JobCancelled`."""
        self._flush(job_id)
        self._running.pop(job_id, None)
        self._send(JobCancelled(job_id, generated))

    def _sleep(self, seconds: float) -> None:
        """Sleep, but keep serving the pipe (cancels act at once); wake for a shutdown."""
        deadline = time.monotonic() + seconds
        while not self._shutdown:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            self._pump(remaining)

    # --- models ----------------------------------------------------------------------------

    def _model_key(self, job: GenerateJob | EmbedJob | LoadModel | UnloadModel) -> tuple[Any, ...]:
        path = Path(job.model_path).expanduser()
        # Checked here because mlx_lm.load treats a missing path as a Hugging Face repo id and
        # tries to download it. (The message names no path: a paired client may read it.)
        if not (path / "config.json").is_file():
            raise JobError("model_not_found", "the model's directory holds no MLX model")
        path = path.resolve()
        if job.expected_files is not None:
            # The registered digest: the weights in memory are the verified registered bytes,
            # so a model re-registered with new files gets a new key (and new prompt caches).
            from ..models.digests import model_digest

            return (str(path), model_digest(job.expected_files))
        # Unregistered (a direct engine user): the listing, so a model rewritten in place is
        # reloaded and its prompt-cache entries are never reused for the new weights.
        return (str(path), _listing(path))

    def _take_loads(self) -> None:
        """Models the loader finished: cache them and put their waiting jobs back at the front
        of the queue (admitted next); fail the jobs of a model that could not be loaded."""
        for result in self._loader.finished():
            jobs = self._waiting.pop(result.key, [])
            if result.cancelled:
                if jobs:  # a job came for it after its load was cancelled: load it again
                    self._waiting[result.key] = jobs
                    self._loader.request(result.key, Path(result.key[0]), jobs[0].expected_files)
                continue
            if result.code is not None:
                self._load_asked.pop(result.key, None)
                for job in jobs:
                    self._send(JobFailed(job.job_id, result.code, result.message))
                continue
            self._cache_model(result)
            asked = self._load_asked.pop(result.key, None)
            if asked is not None:
                self._load_took[result.key] = time.monotonic() - asked
            self._queue.extendleft(reversed([j for j in jobs if isinstance(j, GenerateJob)]))
            for job in jobs:
                if isinstance(job, EmbedJob):
                    self._embed_ready(job, result.key)
                elif isinstance(job, LoadModel):
                    self._residency.used(result.key, job.keep_alive)
                    self._send_loaded(result.key, job.job_id)

    def _cache_model(self, result: LoadResult) -> None:
        assert result.model is not None and result.tokenizer is not None
        install_checkpoints(result.model, self._checkpoints)
        self._models[result.key] = (result.model, result.tokenizer)
        self._models.move_to_end(result.key)
        nbytes = model_bytes(result.model)
        self._residency.loaded(result.key, nbytes)
        self._send(
            ModelLoaded(
                result.key[0], _digest_of(result.key), nbytes, self._residency.resident_bytes
            )
        )
        # Not unloaded for room before its waiting jobs have run.
        self._keep_to_budget(also={result.key})

    def _busy(self) -> set[tuple[Any, ...]]:
        """The models with work in flight: jobs decoding or prefilling on them (the
        scheduler's batches), embeddings queued for them, jobs waiting for their load."""
        batches = getattr(self._scheduler, "_batches", {})
        return set(batches) | self._embeds.keys() | set(self._waiting)

    def _keep_to_budget(self, also: set[tuple[Any, ...]] | None = None) -> None:
        """Unload the idle models over the budget (least recently used first) and those idle
        past their keep-alive; a busy model (or one in `also`) counts as used now."""
        busy = self._busy() | (also or set())
        for key in busy:
            self._residency.used(key)
        for key in self._residency.over_budget(busy):
            self._unload(key, "budget")
        for key in self._residency.expired(busy):
            self._unload(key, "idle")

    def _load_model(self, message: LoadModel) -> None:
        """`LoadModel`: answered at once if the model is loaded, else once its load is done
        (the one load any job of it waits for)."""
        try:
            key = self._model_key(message)
        except JobError as exc:
            self._send(JobFailed(message.job_id, exc.code, exc.message))
            return
        if key in self._models:
            self._models.move_to_end(key)
            self._residency.used(key, message.keep_alive)
            self._send_loaded(key, message.job_id)
            return
        self._waiting.setdefault(key, []).append(message)
        self._load_asked.setdefault(key, time.monotonic())
        self._loader.request(key, Path(key[0]), message.expected_files)

    def _send_loaded(self, key: tuple[Any, ...], job_id: str | None) -> None:
        self._send(
            ModelLoaded(
                key[0],
                _digest_of(key),
                self._residency.nbytes(key),
                self._residency.resident_bytes,
                job_id=job_id,
            )
        )

    def _unload_model(self, message: UnloadModel) -> None:
        """`UnloadModel`: refused while work on the model is in flight."""
        try:
            key = self._model_key(message)
        except JobError as exc:
            self._send(JobFailed(message.job_id, exc.code, exc.message))
            return
        if key not in self._models:
            self._send(
                ModelUnloaded(
                    key[0],
                    _digest_of(key),
                    "not_loaded",
                    self._residency.resident_bytes,
                    job_id=message.job_id,
                )
            )
        elif key in self._busy():
            self._send(
                JobFailed(
                    message.job_id,
                    "model_busy",
                    "The model has work in flight; it can be unloaded once that is done.",
                )
            )
        else:
            self._unload(key, "asked", message.job_id)

    def _unload(self, key: tuple[Any, ...], reason: str, job_id: str | None = None) -> None:
        from jupyter_lmsp.engine.constraints import forget_tokenizer

        self._models.pop(key, None)
        self._scheduler.forget_model(key)
        forget_tokenizer(key)
        self._embed_specs.pop(key, None)
        self._residency.unloaded(key)
        self._send(
            ModelUnloaded(
                key[0], _digest_of(key), reason, self._residency.resident_bytes, job_id=job_id
            )
        )

    # --- embeddings ------------------------------------------------------------------------

    def _embed_job(self, job: EmbedJob) -> None:
        """An embedding job: queued at once if its model is loaded, else after its load."""
        try:
            key = self._model_key(job)
        except JobError as exc:
            self._send(JobFailed(job.job_id, exc.code, exc.message))
            return
        if key in self._models:
            self._models.move_to_end(key)
            self._embed_ready(job, key)
            return
        self._waiting.setdefault(key, []).append(job)
        self._load_asked.setdefault(key, time.monotonic())
        self._loader.request(key, Path(key[0]), job.expected_files)

    def _embed_ready(self, job: EmbedJob, key: tuple[Any, ...]) -> None:
        from jupyter_lmsp.engine.embedding import prepare

        model, tokenizer = self._models[key]
        self._residency.used(key, job.keep_alive)
        try:
            request = prepare(
                job.job_id, key, job.inputs, job.dimensions, model, tokenizer, self._embed_specs
            )
        except EmbeddingError as exc:
            self._send(JobFailed(job.job_id, exc.code, exc.message))
            return
        except Exception as exc:
            log.exception("embedding job %s could not be read", job.job_id)
            self._send(JobFailed(job.job_id, "invalid_request", f"{type(exc).__name__}: {exc}"))
            return
        self._embeds.add(request)

    def _embed_step(self) -> None:
        """One chunk of the embedding queue; the jobs it finished are answered."""
        budget = CHUNK_POSITIONS_BUSY if self._scheduler.active else CHUNK_POSITIONS_IDLE
        try:
            finished = self._embeds.step(budget)
        except EmbeddingError as exc:
            for job_id in self._embeds.drop_all():
                self._send(JobFailed(job_id, exc.code, exc.message))
            return
        except Exception as exc:
            log.exception("an embedding chunk failed")
            for job_id in self._embeds.drop_all():
                self._send(JobFailed(job_id, "embedding_failed", f"{type(exc).__name__}: {exc}"))
            return
        for request in finished:
            vectors = request.result()
            self._send(
                EmbedResult(
                    request.job_id,
                    vectors.astype("<f4").tobytes(),
                    vectors.shape[0],
                    vectors.shape[1],
                    request.tokens,
                    load_seconds=self._load_took.pop(request.key, None),
                    passes=request.passes,
                )
            )

    # --- jobs ------------------------------------------------------------------------------

    def serve(self) -> None:
        import mlx.core as mx

        # Nothing should draw from MLX's global random state (samplers use explicit keys), but
        # if anything does, make it repeatable. The state is per thread: seeded in this one.
        mx.random.seed(0)
        self._send(WorkerReady(os.getpid(), blas=_detect_blas()))
        while not self._shutdown:
            was_idle = not self._scheduler.active
            self._admit()
            if self._embeds.pending:
                # One chunk of embeddings between two decode steps.
                self._embed_step()
                if not self._scheduler.active:
                    self._pump()
                    continue
            self._keep_to_budget()
            if not self._scheduler.active:
                if self._held_since is not None:
                    self._send_held()  # nothing is held while the worker waits
                self._pump(IDLE_POLL_SECONDS)
                continue
            if was_idle:
                self._gather()
            self._step_sizes.append(self._scheduler.load)
            self._checkpoints_for_step()
            began = time.perf_counter()
            try:
                updates = self._scheduler.step()
            except StepAbandoned:
                self._abandon_step()
                continue
            finally:
                self._checkpoints.ask = None
            self._step_seconds.append(time.perf_counter() - began)
            self._deliver(updates)
            if self._token_delay > 0:
                # Per token, not per step: a speculating step may bring a job several.
                self._sleep(self._token_delay * _most_tokens(updates))
            else:
                self._pump()
            self._send_due()
        for job_id, generated in self._scheduler.cancel_all():
            self._end_cancelled(job_id, generated)
        self._embeds.drop_all()
        for job in self._queue:
            self._send(JobCancelled(job.job_id, _resumed_tokens(job)))
        self._queue.clear()
        for jobs in self._waiting.values():
            for held in jobs:
                self._send(JobCancelled(held.job_id, _resumed_tokens(held)))
        self._waiting.clear()
        for job in self._compiling.values():
            self._send(JobCancelled(job.job_id, _resumed_tokens(job)))
        self._compiling.clear()
        self._loader.close()
        self._matchers.close()

    def _fits(self) -> bool:
        """Whether the next queued job's choices fit in the batch now (a job with more choices
        than the batch has rows runs alone)."""
        if not self._queue:
            return False
        load = self._scheduler.load
        return load == 0 or load + max(1, self._queue[0].n) <= self._scheduler.max_batch_size

    def _admit(self) -> None:
        while self._fits():
            job = self._queue.popleft()
            try:
                _validate(job)
                key = self._model_key(job)
                loaded = self._models.get(key)
                if loaded is None:
                    # Verified and loaded in the loader's thread; the job waits, the batch
                    # goes on decoding.
                    self._waiting.setdefault(key, []).append(job)
                    self._load_asked.setdefault(key, time.monotonic())
                    self._loader.request(key, Path(key[0]), job.expected_files)
                    continue
                self._models.move_to_end(key)
                self._residency.used(key, job.keep_alive)
                self._start(job, key, *loaded)
            except JobError as exc:
                self._send(JobFailed(job.job_id, exc.code, exc.message))
            except _ParentGone:
                raise
            except Exception as exc:
                log.exception("job %s failed to start", job.job_id)
                self._send(
                    JobFailed(job.job_id, "generation_failed", f"{type(exc).__name__}: {exc}")
                )
            # A model load can take seconds: take cancels (and new jobs) in between.
            self._pump()
            if self._shutdown:
                return

    def _gather(self) -> None:
        """Admit the jobs that keep arriving, until the batch is full or the gather limit is
        reached: while announced jobs are still to come, or until none has come for the gather
        window (or twice the longest gap between them, if longer), a window no longer than
        GATHER_STEPS of the recent decode steps."""
        last = time.monotonic()
        limit = last + self._gather_limit
        # The bound holds for the window stretched to the burst's pace too: announced jobs
        # are waited for anyway (`_expecting`), and one that was not announced joins at the
        # next step (a burst whose jobs came 17 ms apart made a fast model wait 35 ms after
        # the last of them, issue 42).
        most = math.inf
        if self._step_seconds and self._gather_steps > 0:
            most = self._gather_steps * min(self._step_seconds)
        quiet = min(self._gather_window, most)
        while not self._shutdown and self._scheduler.load < self._scheduler.max_batch_size:
            now = time.monotonic()
            deadline = limit if self._expecting(now) else min(last + quiet, limit)
            if now >= deadline:
                return
            queued = len(self._queue)
            self._pump(deadline - now)
            if len(self._queue) > queued:
                arrived = time.monotonic()
                quiet = min(max(quiet, 2 * (arrived - last)), most)
                last = arrived
                self._admit()

    def _expecting(self, now: float) -> bool:
        """Whether announced jobs are still to come (announcements older than the gather
        limit are forgotten: their jobs were never sent, e.g. cancelled while queued)."""
        for job_id, announced in list(self._coming.items()):
            if now - announced > self._gather_limit:
                del self._coming[job_id]
        return bool(self._coming)

    def _start(
        self, job: GenerateJob, key: tuple[Any, ...], model: nn.Module, tokenizer: TokenizerWrapper
    ) -> None:
        prepared = self._prepared.pop(job.job_id, None)
        if prepared is None:
            prepared = self._prepare(job, key, model, tokenizer)
            if isinstance(prepared.grammar, str):
                # Compiled beside the decode loop (`grammar_prep`): the job comes back to the
                # front of the queue with its matcher (`_take_matchers`).
                self._prepared[job.job_id] = prepared
                self._compiling[job.job_id] = job
                self._matchers.request(job.job_id, key, model, tokenizer, prepared.grammar)
                return
        self._launch(job, key, model, tokenizer, prepared)

    def _prepare(
        self, job: GenerateJob, key: tuple[Any, ...], model: nn.Module, tokenizer: TokenizerWrapper
    ) -> _Prepared:
        from jupyter_lmsp.engine.constraints import ll_tokenizer
        from jupyter_lmsp.engine.toolcalls import render

        call_format = GENERIC
        # A harmony model's output is in channels, calls or not: always parsed (`harmony`).
        calls = (job.tools is not None and job.tools.active) or is_harmony(tokenizer)
        if calls:
            call_format = call_format_of(tokenizer, ll_tokenizer(key, model, tokenizer), job.tools)
        messages, template_args = render(job.messages, job.tools, call_format)
        template_args.update(reasoning_args(tokenizer, job.reasoning_effort))
        prompt_ids = encode_chat(tokenizer, messages, **template_args)
        thinking = Thinking.of(tokenizer, prompt_ids)
        if thinking is not None and job.logprobs:
            # Their text is split into thinking and answer after decoding: a token's entry
            # would belong to neither part.
            raise JobError(
                "invalid_request",
                "Log-probabilities are not available for a model that thinks before it "
                "answers; leave out the logprobs request.",
            )
        try:
            grammar = build_grammar(job.response_format, job.tools, call_format)
        except GrammarError as exc:
            raise JobError("grammar_invalid", str(exc)) from exc
        except (TypeError, ValueError) as exc:
            raise JobError("grammar_invalid", f"the grammar could not be built: {exc}") from exc
        if grammar is not None and thinking is not None:
            # The grammar constrains the answer: the model thinks freely first (`reasoning`).
            grammar = after_thinking(grammar, thinking)
        return _Prepared(prompt_ids, thinking, call_format, calls, grammar)

    def _take_matchers(self) -> None:
        """Matchers built beside the loop: their jobs go back to the front of the queue
        (admitted next), or fail with `grammar_invalid`."""
        for built in self._matchers.finished():
            job = self._compiling.pop(built.job_id, None)
            prepared = self._prepared.get(built.job_id)
            if job is None or prepared is None:
                continue
            if built.error is not None:
                del self._prepared[built.job_id]
                self._send(JobFailed(job.job_id, "grammar_invalid", built.error))
                continue
            prepared.grammar = built.matcher
            self._queue.appendleft(job)

    def _launch(
        self,
        job: GenerateJob,
        key: tuple[Any, ...],
        model: nn.Module,
        tokenizer: TokenizerWrapper,
        prepared: _Prepared,
    ) -> None:
        from jupyter_lmsp.engine.constraints import ConstraintError

        prompt_ids, thinking = prepared.prompt_ids, prepared.thinking
        call_format, calls = prepared.call_format, prepared.calls
        reused_before = self._scheduler.prompt_cache.stats().reused_bytes
        try:
            cached_tokens, updates = self._scheduler.add(
                job, key, model, tokenizer, prompt_ids, prepared.grammar, thinking
            )
        except ConstraintError as exc:
            raise JobError("grammar_invalid", str(exc)) from exc
        points = job.resume_points()
        self._running[job.job_id] = _Running(
            job.job_id,
            len(prompt_ids),
            [
                _Outbox(
                    job.job_id,
                    i,
                    len(point.token_ids),
                    want_logprobs=job.logprobs,
                    reasoning=_counter(thinking, point.token_ids),
                )
                for i, point in enumerate(points)
            ],
        )
        self._send(
            JobStarted(
                job.job_id,
                len(prompt_ids),
                cached_tokens=cached_tokens,
                tool_format=call_format.name if calls else None,
                thinking=thinking,
                cache_bytes=self._scheduler.prompt_cache.nbytes,
                cache_reused_bytes=self._scheduler.prompt_cache.stats().reused_bytes
                - reused_before,
                load_seconds=self._load_took.pop(key, None),
            )
        )
        self._deliver(updates)

    def _deliver(self, updates: list[Update]) -> None:
        for update in updates:
            running = self._running.get(update.job_id)
            if running is None:  # Cannot happen; a message for an unknown job would mislead.
                log.warning("update for unknown job %s", update.job_id)
                continue
            outbox = running.outboxes[update.choice]
            outbox.add(update)
            if update.token_ids or update.text:
                if self._held_since is None:
                    self._held_since = time.monotonic()
                if update.text and not outbox.sent_text:
                    self._first_text = True
            if update.error is not None:
                # Tokens generated before a failure are valid: they go out before JobFailed.
                self._flush(update.job_id)
                del self._running[update.job_id]
                self._send(JobFailed(update.job_id, update.error_code, update.error))
                continue
            if update.finish_reason is None:
                continue
            self._flush_outbox(outbox)
            result = ChoiceResult(
                update.choice,
                update.finish_reason,
                outbox.output_tokens,
                outbox.accepted_draft_tokens,
                outbox.reasoning_tokens,
            )
            running.results[update.choice] = result
            if len(running.outboxes) > 1:
                self._send(
                    ChoiceFinished(
                        update.job_id,
                        update.choice,
                        update.finish_reason,
                        outbox.output_tokens,
                        outbox.accepted_draft_tokens,
                        outbox.reasoning_tokens,
                    )
                )
            if len(running.results) < len(running.outboxes):
                continue
            del self._running[update.job_id]
            choices = [running.results[i] for i in range(len(running.outboxes))]
            self._send(
                JobFinished(
                    update.job_id,
                    choices[0].finish_reason,
                    running.input_tokens,
                    sum(choice.output_tokens for choice in choices),
                    choices,
                    sum(choice.accepted_draft_tokens for choice in choices),
                    sum(choice.reasoning_tokens for choice in choices),
                )
            )

    def _flush(self, job_id: str) -> None:
        running = self._running.get(job_id)
        if running is None:
            return
        for outbox in running.outboxes:
            self._flush_outbox(outbox)

    def _send_due(self) -> None:
        """`_send_held` once it is due: a choice's first text is waiting, or the oldest token
        held has waited `send_interval` (issue 42: one message per interval instead of one
        per decode step, which cost the worker a pickle and the server's loop a wake-up, a
        read and a hand-off per step; the tokens reach watchers no later than when the
        server's runner held them for that interval instead)."""
        held = self._held_since
        if held is None:
            return
        if self._first_text or time.monotonic() - held >= self._send_interval:
            self._send_held()

    def _send_held(self) -> None:
        """Every running choice's tokens not yet sent, in one `StepTokens`."""
        self._held_since = None
        self._first_text = False
        rows = [
            message
            for running in self._running.values()
            for outbox in running.outboxes
            if (message := outbox.take()) is not None
        ]
        if rows:
            self._send(StepTokens(rows, time.process_time()))

    def _flush_outbox(self, outbox: _Outbox) -> None:
        message = outbox.take()
        if message is not None:
            self._send(message)


def _most_tokens(updates: list[Update]) -> int:
    """The most tokens one choice of one job got from a step (1 when none got any)."""
    counts: dict[tuple[str, int], int] = {}
    for update in updates:
        key = (update.job_id, update.choice)
        counts[key] = counts.get(key, 0) + len(update.token_ids)
    return max(1, *counts.values()) if counts else 1


def _resumed_tokens(job: GenerateJob | EmbedJob | LoadModel) -> int:
    """The tokens a job had generated before it came (all its choices)."""
    if not isinstance(job, GenerateJob):
        return 0
    return sum(len(point.token_ids) for point in job.resume_points())


def _digest_of(key: tuple[Any, ...]) -> str | None:
    """A model key's registered digest (None for an unregistered model's listing key)."""
    return key[1] if len(key) > 1 and isinstance(key[1], str) else None


def _listing(path: Path) -> tuple[tuple[str, int, int], ...]:
    stats = ((entry.name, entry.stat()) for entry in path.iterdir())
    return tuple(sorted((name, st.st_size, st.st_mtime_ns) for name, st in stats))


def _validate(job: GenerateJob) -> None:
    if job.max_tokens < 1:
        raise JobError("invalid_request", f"max_tokens must be >= 1, got {job.max_tokens}")
    if job.temperature < 0:
        raise JobError("invalid_request", f"temperature must be >= 0, got {job.temperature}")
    if not 0 < job.top_p <= 1:
        raise JobError("invalid_request", f"top_p must be in (0, 1], got {job.top_p}")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(job, name)
        if not (isinstance(value, int | float) and -PENALTY_LIMIT <= value <= PENALTY_LIMIT):
            raise JobError("invalid_request", f"{name} must be in -2..2, got {value!r}")
    if len(job.stop) > MAX_STOP_SEQUENCES:
        raise JobError("invalid_request", f"at most {MAX_STOP_SEQUENCES} stop sequences")
    if any(not isinstance(stop, str) or not stop for stop in job.stop):
        raise JobError("invalid_request", "a stop sequence must be a non-empty string")
    if not 0 <= job.top_logprobs <= MAX_TOP_LOGPROBS:
        raise JobError("invalid_request", f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}")
    if job.top_logprobs and not job.logprobs:
        raise JobError("invalid_request", "top_logprobs needs logprobs")
    if job.n < 1:
        raise JobError("invalid_request", f"n must be >= 1, got {job.n}")
    if job.max_reasoning_tokens is not None and not (
        isinstance(job.max_reasoning_tokens, int) and job.max_reasoning_tokens >= 0
    ):
        raise JobError("invalid_request", "max_reasoning_tokens must be an integer >= 0")
    if job.resume_choices is not None and len(job.resume_choices) != job.n:
        raise JobError("invalid_request", f"resume_choices must have n = {job.n} entries")


def _detect_blas() -> str:
    """Which BLAS MLX's CPU backend is using: what matters for CPU decode speed."""
    if sys.platform == "darwin":
        return "accelerate"
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "unknown"
    # Only a libopenblas mapped into the process counts (preloaded for MLX: README, "The
    # worker's BLAS"); numpy's bundled libscipy_openblas64_ is loaded too but MLX ignores it.
    libraries = {Path(line.split()[-1]).name for line in maps.splitlines() if "/" in line}
    if any(name.startswith("libopenblas") for name in libraries):
        return "openblas"
    return "reference"


def _die_with_parent(parent_pid: int | None) -> None:
    """Make sure this process does not outlive the server process."""
    if sys.platform.startswith("linux"):
        # Caveat: the signal fires when the parent *thread* that spawned us exits, which is why
        # the client spawns workers from a thread that lives as long as its process.
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    # The parent may have died before prctl took effect.
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(0)


def worker_main(
    conn: Connection,
    token_delay: float = 0.0,
    parent_pid: int | None = None,
    settings: WorkerSettings | None = None,
) -> None:
    """Entry point of the worker process; returns when told to shut down or orphaned.

    `token_delay` > 0 sleeps that long per token after each step (times the most tokens the
    step brought one job's choice: a test and demo hook that makes generation slow enough to
    cancel or kill mid-run, speculating or not). `parent_pid` is the server process's pid;
    the worker exits when its parent changes. `settings` say how many jobs decode at once,
    the prompt cache's budget (0 turns it off), how long a burst is gathered and how the
    worker speculates.
    """
    settings = settings or WorkerSettings()
    _die_with_parent(parent_pid)
    # Ctrl+C in the server's terminal reaches the whole process group; the server decides
    # when its worker stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Never reach for the network: a model path is always a local directory.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    logging.basicConfig(
        level=logging.WARNING, format="[lmsp worker %(process)d] %(levelname)s %(message)s"
    )
    import mlx.core  # noqa: F401  (import before WorkerReady so the ready worker is warm)
    import mlx_lm  # noqa: F401

    try:
        Worker(
            conn,
            token_delay,
            parent_pid,
            max_batch_size=max(1, settings.max_batch_size),
            prompt_cache_bytes=max(0, settings.prompt_cache_bytes),
            gather_window=settings.gather_window,
            gather_limit=settings.gather_limit,
            gather_steps=settings.gather_steps,
            speculation=settings.speculation,
            residency=Residency(settings.max_loaded_bytes, settings.keep_alive),
            prefill_break_even=settings.prefill_break_even,
            prefill_pacing=settings.prefill_pacing,
            send_interval=settings.send_interval,
        ).serve()
    except _ParentGone:
        pass
    finally:
        with contextlib.suppress(OSError):
            conn.close()
