"""The inference worker process: loads MLX models and generates tokens for `GenerateJob`s.

`worker_main` is the entry point of a process started with the multiprocessing *spawn* context
(see `client.EngineClient`). It talks to the server process only through the pipe, in the
messages of `messages`. Generation runs here rather than in a thread of the server because
building each step's graph holds the GIL, which stalls the server's event loop.

Layout:
- `generate_job` is generation as a plain generator (one `Step` per token), built on
  `mlx_lm.generate.generate_step`; a batching scheduler can later replace it without touching
  the message handling.
- `Worker` is the loop: a FIFO queue of jobs run one at a time, the pipe polled between decode
  steps so cancels act within one step, tokens coalesced for at most ~20 ms.

This module imports MLX only inside the worker process (in `worker_main` and the functions it
calls), so the server process can import it to name the process target without loading MLX.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jupyter_lmsp.engine.messages import (
    CancelJob,
    GenerateJob,
    JobCancelled,
    JobFailed,
    JobFinished,
    JobStarted,
    JobTokens,
    Shutdown,
    WorkerReady,
)

if TYPE_CHECKING:
    import mlx.nn as nn
    from mlx_lm.tokenizer_utils import TokenizerWrapper

log = logging.getLogger(__name__)

# Tokens produced within this window may travel in one JobTokens message; no token is held
# (much) longer than this.
COALESCE_WINDOW = 0.02
# Loaded models kept in memory, least recently used evicted first.
MAX_CACHED_MODELS = 2
# How often an idle worker wakes up to check that its parent is still alive.
IDLE_POLL_SECONDS = 0.5

_PR_SET_PDEATHSIG = 1


@dataclass
class Step:
    """What one generation step produced.

    `token_ids` holds the new token (empty on a final step that produced none, e.g. EOS);
    `text` is the text it completed, possibly "" (a partial UTF-8 character is held back until
    it is complete). `finish_reason` is set on the last step: "stop" (EOS) or "length".
    """

    token_ids: list[int]
    text: str
    finish_reason: str | None = None


class JobError(Exception):
    """A job failed for a reason the caller can act on; `code` goes into `JobFailed`."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class _Cancelled(Exception):
    """Raised from the prefill progress callback to abandon a long prefill."""


class _ParentGone(Exception):
    """The server process is gone: the pipe hit EOF or our parent pid changed."""


def encode_chat(tokenizer: TokenizerWrapper, messages: list[dict[str, str]]) -> list[int]:
    """Apply the model's chat template (with the assistant prompt) and tokenize."""
    if not messages:
        raise JobError("invalid_request", "no messages to generate a reply to")
    try:
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as exc:
        raise JobError("template_failed", f"chat template failed: {exc}") from exc
    if not isinstance(prompt, str):
        raise JobError("template_failed", "chat template did not render to text")
    # The template already holds every special token the model expects (BOS included, where
    # it has one); encoding with special tokens again would double them.
    ids: list[int] = tokenizer.encode(prompt, add_special_tokens=False)
    if not ids:
        raise JobError("invalid_request", "the prompt is empty")
    return ids


def generate_job(
    model: nn.Module,
    tokenizer: TokenizerWrapper,
    prompt_ids: list[int],
    job: GenerateJob,
    *,
    prompt_progress_callback: Callable[[int, int], None] | None = None,
) -> Iterator[Step]:
    """Generate for `job`, one `Step` per token, continuing after `job.resume_token_ids`.

    A resumed job re-prefills prompt + resumed tokens, samples from position
    len(resume_token_ids) on, and primes the streaming detokenizer with the resumed tokens,
    so its tokens and text continue an uninterrupted run's exactly. `job.resume_text` is the
    text already emitted for the resumed tokens; only text beyond it is yielded.

    Close the generator to stop early (that is how cancel works). Raising from
    `prompt_progress_callback` abandons the prefill.
    """
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from jupyter_lmsp.engine.sampling import make_sampler

    eos_ids = tokenizer.eos_token_ids
    resumed = list(job.resume_token_ids)
    generated = len(resumed)
    detokenizer = tokenizer.detokenizer
    for token in resumed:
        detokenizer.add_token(token)
    # Text is tracked by length against the detokenizer's (monotonically growing) text: the
    # resumed text is a prefix of it, possibly minus a trailing character still incomplete.
    emitted = len(job.resume_text)

    def new_text(final: bool = False) -> str:
        nonlocal emitted
        if final:
            # Flushes bytes held back (an incomplete character at the very end, or a space
            # kept waiting for the next token), as an uninterrupted run does when it ends.
            detokenizer.finalize()
        text: str = detokenizer.text
        if len(text) <= emitted:
            return ""
        chunk = text[emitted:]
        emitted = len(text)
        return chunk

    if resumed and resumed[-1] in eos_ids:
        yield Step([], new_text(final=True), "stop")
        return
    if generated >= job.max_tokens:
        yield Step([], new_text(final=True), "length")
        return

    sampler = make_sampler(job.temperature, job.top_p, job.seed, start_position=generated)
    tokens = generate_step(
        mx.array(prompt_ids + resumed),
        model,
        max_tokens=job.max_tokens - generated,
        sampler=sampler,
        prompt_progress_callback=prompt_progress_callback,
    )
    try:
        for token, _logprobs in tokens:
            if token in eos_ids:
                yield Step([], new_text(final=True), "stop")
                return
            detokenizer.add_token(token)
            generated += 1
            if generated >= job.max_tokens:
                yield Step([token], new_text(final=True), "length")
                return
            yield Step([token], new_text())
    finally:
        tokens.close()


@dataclass
class _Outbox:
    """Tokens generated but not yet sent, coalesced into one JobTokens message."""

    job_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    since: float = 0.0

    def add(self, step: Step, now: float) -> None:
        if not self.token_ids and not self.text:
            self.since = now
        self.token_ids.extend(step.token_ids)
        self.text += step.text

    def take(self) -> JobTokens | None:
        if not self.token_ids and not self.text:
            return None
        message = JobTokens(self.job_id, self.token_ids, self.text)
        self.token_ids, self.text = [], ""
        return message


class Worker:
    """The worker's main loop: a FIFO of jobs, run one at a time, cancellable between steps."""

    def __init__(
        self, conn: Connection, token_delay: float = 0.0, parent_pid: int | None = None
    ) -> None:
        self._conn = conn
        self._token_delay = token_delay
        self._parent_pid = parent_pid
        self._queue: deque[GenerateJob] = deque()
        self._models: OrderedDict[tuple[Any, ...], tuple[nn.Module, TokenizerWrapper]] = (
            OrderedDict()
        )
        self._current: str | None = None
        self._cancel_requested = False
        self._shutdown = False

    # --- pipe ------------------------------------------------------------------------------

    def _send(self, message: object) -> None:
        try:
            self._conn.send(message)
        except (OSError, EOFError) as exc:
            raise _ParentGone from exc

    def _pump(self, timeout: float = 0.0) -> None:
        """Handle every message already in the pipe, waiting up to `timeout` for the first."""
        try:
            ready = self._conn.poll(timeout)
            while ready:
                self._handle(self._conn.recv())
                ready = self._conn.poll(0)
        except (OSError, EOFError) as exc:
            raise _ParentGone from exc
        if self._parent_pid is not None and os.getppid() != self._parent_pid:
            raise _ParentGone

    def _handle(self, message: object) -> None:
        if isinstance(message, GenerateJob):
            self._queue.append(message)
        elif isinstance(message, CancelJob):
            if message.job_id == self._current:
                self._cancel_requested = True
                return
            for job in self._queue:
                if job.job_id == message.job_id:
                    self._queue.remove(job)
                    self._send(JobCancelled(job.job_id, len(job.resume_token_ids)))
                    return
            # Unknown id: the job already ended and its final message is on its way.
        elif isinstance(message, Shutdown):
            self._shutdown = True
            if self._current is not None:
                self._cancel_requested = True
        else:
            log.warning("worker ignores unexpected message %r", message)

    def _sleep(self, seconds: float) -> None:
        """Sleep, but keep serving the pipe, and wake at once for a cancel of the job."""
        deadline = time.monotonic() + seconds
        while not self._cancel_requested:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            self._pump(remaining)

    # --- models ----------------------------------------------------------------------------

    def _model(self, model_path: str) -> tuple[nn.Module, TokenizerWrapper]:
        path = Path(model_path).expanduser()
        # Checked here because mlx_lm.load treats a missing path as a Hugging Face repo id and
        # tries to download it.
        if not (path / "config.json").is_file():
            raise JobError("model_not_found", f"no MLX model directory at {model_path}")
        path = path.resolve()
        # The file listing is part of the key so a model rewritten in place is reloaded.
        key = (str(path), _listing(path))
        if key in self._models:
            self._models.move_to_end(key)
            return self._models[key]
        from mlx_lm import load

        try:
            model, tokenizer = load(str(path))
        except Exception as exc:
            log.exception("loading %s failed", path)
            raise JobError("model_load_failed", f"{type(exc).__name__}: {exc}") from exc
        self._models[key] = (model, tokenizer)
        while len(self._models) > MAX_CACHED_MODELS:
            self._models.popitem(last=False)
        return model, tokenizer

    # --- jobs ------------------------------------------------------------------------------

    def serve(self) -> None:
        self._send(WorkerReady(os.getpid(), blas=_detect_blas()))
        while not self._shutdown:
            if self._queue:
                self._run(self._queue.popleft())
            else:
                self._pump(IDLE_POLL_SECONDS)
        for job in self._queue:
            self._send(JobCancelled(job.job_id, len(job.resume_token_ids)))
        self._queue.clear()

    def _run(self, job: GenerateJob) -> None:
        self._current = job.job_id
        self._cancel_requested = False
        try:
            _validate(job)
            model, tokenizer = self._model(job.model_path)
            prompt_ids = encode_chat(tokenizer, job.messages)
            self._pump()
            if self._cancel_requested:
                self._send(JobCancelled(job.job_id, len(job.resume_token_ids)))
                return
            self._send(JobStarted(job.job_id, len(prompt_ids)))
            self._generate(job, model, tokenizer, prompt_ids)
        except JobError as exc:
            self._send(JobFailed(job.job_id, exc.code, exc.message))
        except _ParentGone:
            raise
        except Exception as exc:
            log.exception("job %s failed", job.job_id)
            self._send(JobFailed(job.job_id, "generation_failed", f"{type(exc).__name__}: {exc}"))
        finally:
            self._current = None
            self._cancel_requested = False

    def _generate(
        self,
        job: GenerateJob,
        model: nn.Module,
        tokenizer: TokenizerWrapper,
        prompt_ids: list[int],
    ) -> None:
        import mlx.core as mx

        # Nothing here should draw from MLX's global random state (samplers use explicit
        # keys), but if anything does, make it repeatable. The state is per thread, so it is
        # seeded in the thread that generates.
        mx.random.seed(job.seed & 0xFFFFFFFF)

        def on_prefill(_done: int, _total: int) -> None:
            self._pump()
            if self._cancel_requested:
                raise _Cancelled

        outbox = _Outbox(job.job_id)
        output_tokens = len(job.resume_token_ids)
        # Expected time until the next step arrives; the first token is never held back.
        step_interval = float("inf")
        last_step_at: float | None = None

        def flush() -> None:
            message = outbox.take()
            if message is not None:
                self._send(message)

        steps = generate_job(model, tokenizer, prompt_ids, job, prompt_progress_callback=on_prefill)
        try:
            for step in steps:
                now = time.monotonic()
                if last_step_at is not None:
                    step_interval = now - last_step_at
                last_step_at = now
                outbox.add(step, now)
                output_tokens += len(step.token_ids)
                if step.finish_reason is not None:
                    flush()
                    self._send(
                        JobFinished(job.job_id, step.finish_reason, len(prompt_ids), output_tokens)
                    )
                    return
                if self._token_delay > 0:
                    self._sleep(self._token_delay)
                else:
                    self._pump()
                if self._cancel_requested:
                    flush()
                    self._send(JobCancelled(job.job_id, output_tokens))
                    return
                # Hold tokens only while the next one is expected inside the window.
                if time.monotonic() - outbox.since + step_interval >= COALESCE_WINDOW:
                    flush()
        except _Cancelled:
            flush()
            self._send(JobCancelled(job.job_id, output_tokens))
        except _ParentGone:
            raise
        except Exception:
            # Tokens generated before the failure are valid; deliver them before JobFailed.
            flush()
            raise
        finally:
            steps.close()


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


def _detect_blas() -> str:
    """Which BLAS MLX's CPU backend is using: what matters for CPU decode speed."""
    if sys.platform == "darwin":
        return "accelerate"
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "unknown"
    # Only a libopenblas mapped into the process counts (preloaded for MLX, see
    # ENGINEERING.md); numpy's bundled libscipy_openblas64_ is loaded too but MLX ignores it.
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


def worker_main(conn: Connection, token_delay: float = 0.0, parent_pid: int | None = None) -> None:
    """Entry point of the worker process; returns when told to shut down or orphaned.

    `token_delay` > 0 sleeps that long after each token (a test and demo hook that makes
    generation slow enough to cancel or kill mid-run). `parent_pid` is the server process's
    pid; the worker exits when its parent changes.
    """
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
        Worker(conn, token_delay, parent_pid).serve()
    except _ParentGone:
        pass
    finally:
        with contextlib.suppress(OSError):
            conn.close()
