"""The messages between the server process and the inference worker process.

All are plain dataclasses, pickled over a `multiprocessing` pipe. Server → worker: `JobComing`,
`GenerateJob`, `EmbedJob`, `CancelJob`, `Shutdown`. Worker → server: `JobStarted`, `StepTokens` (a
step's `JobTokens`, one per row), `JobTokens`, `ChoiceFinished`, `JobFinished`, `EmbedResult`,
`JobFailed`, `JobCancelled`, `WorkerReady`. `WorkerExited` is
not sent by the worker: the client in the server process produces it when the worker process
dies unexpectedly.

A job generates `n` choices (default 1), each with its own tokens, text, finish reason and, when
asked for, log-probabilities; every `JobTokens` names its `choice`. With n == 1 the messages are
exactly those of a single generation (no `ChoiceFinished`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from jupyter_lmsp.engine.grammars import ResponseFormat, ToolSpec
from jupyter_lmsp.engine.prefill import DEFAULT_BREAK_EVEN
from jupyter_lmsp.engine.speculative import SpeculationSettings
from jupyter_lmsp.engine.thinking import Thinking

# Bounds the worker enforces (a job outside them fails with `invalid_request`): the wire's own,
# defined once in protocol.tools (requests over them are refused before they get here); the
# worker imports them from here.
from jupyter_lmsp.protocol.tools import MAX_STOP_SEQUENCES as MAX_STOP_SEQUENCES
from jupyter_lmsp.protocol.tools import MAX_TOP_LOGPROBS as MAX_TOP_LOGPROBS


@dataclass
class ChoiceResume:
    """Where one choice of a resumed job stands: its committed tokens and the text emitted for
    them, and its finish reason if it had already ended (it is then not generated again)."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None


# The default of `WorkerSettings.send_interval` (and of the extension's `snapshot_interval`).
DEFAULT_SEND_INTERVAL = 0.05


@dataclass(frozen=True)
class WorkerSettings:
    """How the worker runs, from the extension's configuration (`LMSPExtension` traits),
    handed to the worker process when it starts: how many jobs decode together, the prompt
    cache's memory, how long an idle worker gathers a burst of jobs before its first step
    (seconds: until no job came for `gather_window`, at most `gather_limit`), and how it
    speculates (`speculative_decoding`, `speculative_max_draft`, `speculative_max_rows`)."""

    max_batch_size: int = 8
    prompt_cache_bytes: int = 1 << 30
    gather_window: float = 0.02
    gather_limit: float = 0.15
    # The window never exceeds this many of the worker's recent decode steps (0: no bound;
    # `worker.GATHER_STEPS`): on a fast model a job that misses the gathering loses less at
    # the next step than every job loses to the wait.
    gather_steps: float = 2.0
    # Speculative decoding (`speculative`): on by default.
    speculation: SpeculationSettings = field(default_factory=SpeculationSettings)
    # Loaded models (`residency`): the bytes their weights may take (0: half the machine's
    # memory), and how long an idle one stays loaded (seconds; negative: until evicted).
    max_loaded_bytes: int = 0
    keep_alive: float = 300.0
    # The prefill cost model's K (`prefill`): how fast a long prompt's chunks shrink while
    # other rows decode. A huge value keeps every chunk at the full step (the benchmark's
    # comparison).
    prefill_break_even: int = DEFAULT_BREAK_EVEN
    # Whether chunk sizes follow what the chunks cost when read (`prefill.ChunkPacer`); off,
    # the cost model alone sizes them (the benchmark's comparisons).
    prefill_pacing: bool = True
    # How long generated tokens are held before they go to the server (seconds; the
    # extension's `snapshot_interval`): the one stage that coalesces them. A choice's first
    # text goes at once; 0 sends every decode step's tokens.
    send_interval: float = DEFAULT_SEND_INTERVAL


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
    messages: list[dict[str, Any]]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    resume_token_ids: list[int] = field(default_factory=list)
    resume_text: str = ""
    # The model's registered files ({"path", "size", "sha256"}): loading verifies them first
    # and fails the job with `model_digest_mismatch` if any differs (LMSP B4).
    expected_files: list[dict[str, Any]] | None = None
    # Up to MAX_STOP_SEQUENCES non-empty strings, matched on the decoded text: a choice ends
    # ("stop") where one begins, and neither it nor anything after it is output.
    stop: list[str] = field(default_factory=list)
    # Log-probabilities of the generated tokens (`JobTokens.logprobs`), with the
    # `top_logprobs` (0..MAX_TOP_LOGPROBS) most likely alternatives of each step.
    logprobs: bool = False
    top_logprobs: int = 0
    # Choices generated side by side from one prefill of the prompt; choice i samples with
    # `sampling.choice_seed(seed, i)` (choice 0 with `seed` itself).
    n: int = 1
    # Resuming a job with n > 1: one entry per choice (resume_token_ids/resume_text are then
    # ignored). With n == 1 either form works.
    resume_choices: list[ChoiceResume] | None = None
    # Structured output: the text is JSON under this format (grammar-constrained).
    response_format: ResponseFormat | None = None
    # Function tools: rendered into the prompt and, unless the choice is "none", the output is
    # constrained to text and/or calls in the model's call format (see `toolcalls`).
    tools: ToolSpec | None = None
    # OpenAI's presence and frequency penalties (-2..2): each step's logits less
    # `frequency_penalty` x count(t) + `presence_penalty` x (count(t) > 0), counting the tokens
    # this choice generated, the resumed ones included (`penalties`).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Reasoning (`reasoning`): the effort, as the chat template's switch ("none" .. "xhigh";
    # None: the template's default), and the most tokens a choice writes inside its thinking
    # block before its end marker is forced (None: no limit).
    reasoning_effort: str | None = None
    max_reasoning_tokens: int | None = None
    # How long the model stays loaded once idle after this job (`residency`; None: the
    # worker's keep-alive, 0: unloaded when done, negative: until evicted).
    keep_alive: float | None = None

    def resume_points(self) -> list[ChoiceResume]:
        """Each choice's resume point (empty token lists for a fresh job)."""
        if self.resume_choices is not None:
            return list(self.resume_choices)
        first = ChoiceResume(list(self.resume_token_ids), self.resume_text)
        return [first] + [ChoiceResume([], "") for _ in range(self.n - 1)]


@dataclass
class EmbedJob:
    """Embed `inputs` with a model (issue 39, `embedding`): each a text (encoded with the
    model's tokenizer, its special tokens added) or a list of token ids. Vectors are pooled as
    the model's configuration says, truncated to `dimensions` if given (an embedding model
    only) and of unit length. Answered by `EmbedResult`, or `JobFailed` (`invalid_request`,
    `embedding_unsupported`, the model's load failures); a `CancelJob` drops it silently.
    Its model is verified and loaded as a `GenerateJob`'s is."""

    job_id: str
    model_path: str
    inputs: list[str | list[int]]
    dimensions: int | None = None
    expected_files: list[dict[str, Any]] | None = None
    # As `GenerateJob.keep_alive`.
    keep_alive: float | None = None


@dataclass
class EmbedResult:
    """An `EmbedJob`'s vectors: `count` rows of `size` float32 values (little-endian, row after
    row) in `vectors`, in the order of its inputs; `input_tokens` over all its inputs."""

    job_id: str
    vectors: bytes
    count: int
    size: int
    input_tokens: int
    load_seconds: float | None = None
    # The rows of each forward pass that computed some of its inputs (with other jobs' rows).
    passes: list[int] = field(default_factory=list)


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
class SlotsWanted:
    """How many tasks wait in the server's queue for a batch row, as of when it was sent: only
    when whether any wait changes (the worker acts on that alone, and a burst of creates would
    otherwise send one per create), so the worker reads it as "some wait" or "none".

    While some wait, a cancel should hand its slot over at once: the worker then checks its
    decode steps part-way for cancels (see `worker.Worker._checkpoints_for_step`). Only a
    hint: a wrong count costs a few percent of decode speed or a slower hand-over.
    """

    count: int


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
    # When the job has tools (and tool_choice is not "none"): the call format its output uses,
    # for `toolcalls.ToolCallParser` ("generic" or the mlx-lm parser name, e.g. "json_tools").
    tool_format: str | None = None
    # A thinking model's markers, and whether the prompt opened the block: the server splits
    # each choice's text into reasoning and answer by them (`engine.thinking`).
    thinking: Thinking | None = None
    # For the server's metrics: the prompt cache's size after this job's lookup, the bytes of
    # key/value cache its reused tokens took from it, and, for the first job started after its
    # model was verified and loaded, how long that took.
    cache_bytes: int | None = None
    cache_reused_bytes: int = 0
    load_seconds: float | None = None


@dataclass
class TopLogprob:
    """One candidate token of a step: its id, text, bytes and log-probability."""

    token_id: int
    # The token's bytes decoded as UTF-8 (a partial character becomes U+FFFD): use `bytes`
    # for the exact value.
    text: str
    bytes: list[int]
    logprob: float


@dataclass
class TokenLogprob(TopLogprob):
    """A generated token's log-probability and the step's `top` alternatives, most likely
    first (`len(top)` is the job's top_logprobs, or fewer when fewer tokens had any
    probability, e.g. under top_p or a grammar). See `logprobs` for the distribution."""

    top: list[TopLogprob] = field(default_factory=list)


@dataclass
class JobTokens:
    """Newly generated tokens of one choice and the text they completed.

    `text` may be "" (half a character, or characters held back because they could begin a
    stop sequence); `token_ids` and `text` together are what a snapshot commits, and a job
    resumed from them continues exactly as an uninterrupted one. `logprobs`, when the job
    asked for them, has one entry per token of `token_ids`, in order.
    """

    job_id: str
    token_ids: list[int]
    text: str
    choice: int = 0
    logprobs: list[TokenLogprob] | None = None
    # For the server's metrics: the batch size (rows decoded together) of each step the worker
    # took since the last message that carried them.
    batch_sizes: list[int] = field(default_factory=list)

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            JobTokens,
            (
                self.job_id,
                self.token_ids,
                self.text,
                self.choice,
                self.logprobs,
                self.batch_sizes,
            ),
        )


@dataclass
class StepTokens:
    """The tokens one decode step gave its rows, in one message (issue 42: token messages
    batched per step): one `JobTokens` per choice that got any, in the batch's order.

    One message per step, not one per row, because the server's cost per message (a pickle, a
    pipe read, a hand-off to its event loop) is most of its work for a small model, whose
    steps take less than a millisecond. Tokens sent as a job's choice ends or fails (before
    its `ChoiceFinished`/`JobFinished`/`JobFailed`) still go as a lone `JobTokens`. The
    steps' batch sizes not yet reported ride on the first row, as on a lone `JobTokens`.
    """

    rows: list[JobTokens]
    # The worker's CPU time (all its threads, `time.process_time`) as it sent them: how much
    # CPU the worker spent between two of a row's steps, read where it was spent rather than
    # where a busy reader got round to the message (benchmarks/bench_prefill_fairness.py).
    cpu_time: float | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        return (StepTokens, (self.rows, self.cpu_time))


@dataclass
class ChoiceResult:
    """How one choice ended: "stop" (EOS, a stop sequence, or a grammar complete), or
    "length" (max_tokens); its generated tokens, resumed ones included; of the tokens this
    worker generated for it (resumed ones not included), how many speculative decoding
    proposed and verified (`accepted_draft_tokens`)."""

    choice: int
    finish_reason: str
    output_tokens: int
    accepted_draft_tokens: int = 0
    # Of the output tokens, those of the choice's thinking block (markers included).
    reasoning_tokens: int = 0


@dataclass
class ChoiceFinished:
    """One choice of a job with n > 1 ended (its last `JobTokens` came before this); the job
    goes on until every choice has ended. Never sent when n == 1."""

    job_id: str
    choice: int
    finish_reason: str
    output_tokens: int
    accepted_draft_tokens: int = 0
    reasoning_tokens: int = 0


@dataclass
class JobFinished:
    """Generation ended by itself: `finish_reason` is "stop" (EOS, a stop sequence, a grammar
    complete) or "length" (max_tokens); for n > 1 that of choice 0, and `output_tokens` the sum
    over all choices. `choices` has one entry per choice, in order.

    `accepted_draft_tokens`: of the output tokens this worker generated (a resumed job's
    earlier tokens not included), how many speculative decoding proposed and the model
    verified (summed over the choices), like Chat Completions' `accepted_prediction_tokens`.
    They are ordinary output tokens, exactly the ones decoding without speculation gives."""

    job_id: str
    finish_reason: str
    input_tokens: int
    output_tokens: int
    choices: list[ChoiceResult] = field(default_factory=list)
    accepted_draft_tokens: int = 0
    # Of the output tokens, those of the choices' thinking blocks (summed).
    reasoning_tokens: int = 0


@dataclass
class JobFailed:
    """The job failed; tokens sent before are valid. Codes: `invalid_request`,
    `model_not_found`, `model_load_failed`, `model_digest_mismatch`, `template_failed`,
    `grammar_invalid` (the constraint did not compile for this model), `constraint_failed` (the
    grammar matcher failed mid-generation: the job never continues unconstrained),
    `generation_failed`."""

    job_id: str
    code: str
    message: str


@dataclass
class JobCancelled:
    """The job was cancelled; `output_tokens` were generated (over all choices)."""

    job_id: str
    output_tokens: int


@dataclass
class LoadModel:
    """Load a model now (`POST /models/{id}/load`), as a job would; answered by `ModelLoaded`
    with this `job_id` (also when it was loaded already) or `JobFailed`. `keep_alive` as a
    job's."""

    job_id: str
    model_path: str
    expected_files: list[dict[str, Any]] | None = None
    keep_alive: float | None = None


@dataclass
class UnloadModel:
    """Unload a model now (`POST /models/{id}/unload`); answered by `ModelUnloaded` with this
    `job_id` (reason "asked", or "not_loaded"), or `JobFailed` `model_busy` while work on it is
    in flight."""

    job_id: str
    model_path: str
    expected_files: list[dict[str, Any]] | None = None


@dataclass
class ModelLoaded:
    """A model was verified and loaded (`residency`): its folder, registered digest (None for
    an unregistered one), the bytes of its weights and of every loaded model's now; `job_id`
    is the `LoadModel`'s that asked (None for a load a job caused)."""

    path: str
    digest: str | None
    nbytes: int
    resident_bytes: int
    job_id: str | None = None


@dataclass
class ModelUnloaded:
    """A model was unloaded: `reason` "budget" (room for another), "idle" (its keep-alive ran
    out) or "asked"."""

    path: str
    digest: str | None
    reason: str
    resident_bytes: int
    job_id: str | None = None


@dataclass
class WorkerExited:
    """The worker process died without being asked to (made by `EngineClient`, not sent).

    `job_ids` are the jobs submitted to it that had not finished, failed or been cancelled;
    no further message will come for them from this worker.
    """

    pid: int
    exitcode: int | None
    job_ids: list[str]
