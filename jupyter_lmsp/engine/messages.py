"""The messages between the server process and the inference worker process.

All are plain dataclasses, pickled over a `multiprocessing` pipe. Server → worker: `GenerateJob`,
`CancelJob`, `Shutdown`. Worker → server: `JobStarted`, `JobTokens`, `JobFinished`, `JobFailed`,
`JobCancelled`, `WorkerReady`. `WorkerExited` is not sent by the worker: the client in the server
process produces it when the worker process dies unexpectedly.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
    """The model is loaded and the prompt is tokenized; generation begins."""

    job_id: str
    input_tokens: int


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
