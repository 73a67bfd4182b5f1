"""The messages between the server process and the inference worker process.

All are plain dataclasses, pickled over a `multiprocessing` pipe. Server → worker: `JobComing`,
`GenerateJob`, `CancelJob`, `Shutdown`. Worker → server: `JobStarted`, `JobTokens`,
`JobFinished`, `JobFailed`, `JobCancelled`, `WorkerReady`. `WorkerExited` is not sent by the
worker: the client in the server process produces it when the worker process dies unexpectedly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class WorkerSettings:
    """How the worker runs, from the extension's configuration (`LMSPExtension` traits),
    handed to the worker process when it starts: how many jobs decode together, the prompt
    cache's memory, and how long an idle worker gathers a burst of jobs before its first step
    (seconds: until no job came for `gather_window`, at most `gather_limit`)."""

    max_batch_size: int = 8
    prompt_cache_bytes: int = 1 << 30
    gather_window: float = 0.02
    gather_limit: float = 0.15


@dataclass
class GenerateJob:
    """Generate a chat completion.

    `messages` are chat messages (`{"role", "content"}`, instructions already turned into a
    system message); the worker applies the model's chat template. Sampling is greedy when
    `temperature` is 0; otherwise each step's random key is derived from (`seed`, position), so
    a run resumed from a snapshot draws the same tokens as an uninterrupted one.

    Resuming: `resume_token_ids` are the tokens already generated and committed, `resume_text`
    the text already emitted for them. The worker continues after them and emits only new text.
    """

    job_id: str
    model_path: str
    messages: list[dict[str, str]]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    resume_token_ids: list[int] = field(default_factory=list)
    resume_text: str = ""
    # The model's registered files ({"path", "size", "sha256"}): loading verifies them first
    # and fails the job with `model_digest_mismatch` if any differs (LMSP B4).
    expected_files: list[dict[str, Any]] | None = None


@dataclass
class JobComing:
    """A job was accepted and its `GenerateJob` follows once its task is committed `loading`.

    Sent as soon as the server has the task, so an idle worker gathering a burst (see
    `worker.Worker._gather`) knows to wait for it rather than start with fewer jobs. Only a
    hint: a job announced but never sent costs at most one gather limit of waiting.
    """

    job_id: str


@dataclass
class CancelJob:
    job_id: str


@dataclass
class Shutdown:
    pass


@dataclass
class WorkerReady:
    """Sent once the worker process has started and imported MLX."""

    pid: int
    blas: str = "reference"


@dataclass
class JobStarted:
    """The model is loaded and the prompt is tokenized; generation begins.

    `cached_tokens` of the `input_tokens` come from the prompt cache (their KV cache was kept
    from an earlier job sharing the prefix) and are not computed again.
    """

    job_id: str
    input_tokens: int
    cached_tokens: int = 0


@dataclass
class JobTokens:
    """Newly generated tokens and the text they completed (may be "" mid-character)."""

    job_id: str
    token_ids: list[int]
    text: str


@dataclass
class JobFinished:
    """Generation ended by itself: `finish_reason` is "stop" (EOS) or "length" (max_tokens)."""

    job_id: str
    finish_reason: str
    input_tokens: int
    output_tokens: int


@dataclass
class JobFailed:
    job_id: str
    code: str
    message: str


@dataclass
class JobCancelled:
    job_id: str
    output_tokens: int


@dataclass
class WorkerExited:
    """The worker process died without being asked to (made by `EngineClient`, not sent).

    `job_ids` are the jobs submitted to it that had not finished, failed or been cancelled;
    no further message will come for them from this worker.
    """

    pid: int
    exitcode: int | None
    job_ids: list[str]
