"""Continuous batching for the inference worker: the running jobs of a model decode together.

`BatchScheduler` owns the jobs the worker has admitted. Each job:

1. is admitted (`add`): its context (the prompt, plus the tokens already generated when
   resuming) is looked up in the `PromptCache`, and the longest cached prefix is reused;
2. joins its model's `BatchGenerator` (mlx-lm's continuous batching) with the cached prefix and
   the rest of its context. The generator prefills the prompts waiting together as one batch,
   `prefill_step` tokens each per step, and moves each finished prompt into the decoding batch;
3. gets one token per `step` until EOS, max_tokens or a cancel, and leaves the batch at once.

Each step is one decode step of the running jobs plus one prefill chunk of the waiting ones, so
running jobs keep decoding while prompts are read, and a cancel (handled between steps) takes
effect within one step. The KV cache of every prompt, once prefilled, and of every job that
ends goes into the prompt cache, so concurrent jobs sharing a system prompt and follow-up turns
reuse it.

Sampling stays per job: each job has its own sampler from `sampling.make_sampler`, started at its
own position, which `GenerationBatch` calls once per step on that job's row. The random key of
a token depends only on (seed, position), batched or not, resumed or not. Greedy jobs share one
sampler function, which `GenerationBatch` applies to the whole batch at once.

Batched and sequential runs give the same tokens: the batch pads (left for caches, right for
prompt chunks) and masks, and per-row results matched single-sequence runs token for token in
every case tried (tests/test_batching.py; SmolLM2 and the test model, prompts of different
lengths, joined together or staggered, prefill chunks of 16 to 2048).

A model whose cache layers cannot be merged into a batch decodes one job at a time through
`mlx_lm.generate.generate_step` instead (`_SerialDecoder`); its other jobs wait their turn, and a
cancel of the running one waits for its prefill to end.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from jupyter_lmsp.engine.messages import GenerateJob
from jupyter_lmsp.engine.prompt_cache import PromptCache, is_reusable

if TYPE_CHECKING:
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.tokenizer_utils import TokenizerWrapper

log = logging.getLogger(__name__)

# Jobs running at once in one worker, unless configured otherwise.
DEFAULT_MAX_BATCH_SIZE = 8
# Prompt tokens per job prefilled in one step. A step prefills this much of every waiting prompt
# at once, so it bounds how long new prompts stall the running jobs (and a cancel waits): one
# 128-token chunk of SmolLM2-135M takes ~0.6 s on one CPU core with OpenBLAS. Larger chunks are
# barely faster on a CPU (128 vs 2048 within noise).
DEFAULT_PREFILL_STEP = 128

Sampler = Callable[["mx.array"], "mx.array"]


@dataclass
class Update:
    """What one scheduler step produced for one job.

    `token_ids` holds the new token (none on a final "stop" step: EOS is not output); `text` is
    the text it completed, possibly "" (a partial UTF-8 character is held back). A final update
    has `finish_reason` "stop" (EOS) or "length" (max_tokens), or `error` when generation failed
    (tokens sent before it are valid).
    """

    job_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None

    @property
    def final(self) -> bool:
        return self.finish_reason is not None or self.error is not None


class _TextStream:
    """A job's streamed text: a detokenizer primed with the resumed tokens.

    Text is tracked by length against the detokenizer's (monotonically growing) text; the
    resumed text is a prefix of it, possibly minus a trailing character still incomplete, so a
    resumed job emits exactly the text an uninterrupted run would have emitted after it.
    """

    def __init__(self, tokenizer: TokenizerWrapper, resumed: list[int], resume_text: str) -> None:
        self._detokenizer = tokenizer.detokenizer
        for token in resumed:
            self._detokenizer.add_token(token)
        self._emitted = len(resume_text)

    def add(self, token: int) -> None:
        self._detokenizer.add_token(token)

    def take(self, final: bool = False) -> str:
        if final:
            # Flushes bytes held back (an incomplete character at the very end, or a space kept
            # waiting for the next token), as an uninterrupted run does when it ends.
            self._detokenizer.finalize()
        text: str = self._detokenizer.text
        if len(text) <= self._emitted:
            return ""
        chunk = text[self._emitted :]
        self._emitted = len(text)
        return chunk


@dataclass
class _Token:
    """One decoded token of one sequence; a finished sequence brings its KV cache and tokens."""

    uid: int
    token: int
    finish_reason: str | None
    cache: list[Any] | None = None
    cache_tokens: list[int] | None = None


@dataclass
class _Prefilled:
    """A sequence's prompt is prefilled (all but its last token): its cache, for the prompt cache."""

    uid: int
    cache: list[Any]
    cache_tokens: list[int]


class _Decoder(Protocol):
    def __len__(self) -> int: ...

    def insert(
        self,
        prompt: list[int],
        cache: list[Any],
        cache_tokens: list[int],
        sampler: Sampler,
        max_tokens: int,
    ) -> int: ...

    def remove(self, uid: int) -> tuple[list[Any], list[int]] | None: ...

    def next(self) -> tuple[list[_Prefilled], list[_Token]]: ...

    def close(self) -> None: ...


class _BatchDecoder:
    """A model's batch: mlx-lm's `BatchGenerator`, prefilling and decoding its sequences."""

    def __init__(
        self, model: nn.Module, eos_ids: set[int], max_batch_size: int, prefill_step: int
    ) -> None:
        from mlx_lm.generate import BatchGenerator

        self._generator = BatchGenerator(
            model,
            stop_tokens=[[token] for token in sorted(eos_ids)],
            completion_batch_size=max_batch_size,
            prefill_batch_size=max_batch_size,
            prefill_step_size=prefill_step,
        )
        self._uids: set[int] = set()

    def __len__(self) -> int:
        return len(self._uids)

    def insert(
        self,
        prompt: list[int],
        cache: list[Any],
        cache_tokens: list[int],
        sampler: Sampler,
        max_tokens: int,
    ) -> int:
        # One segment: BatchGenerator splits its last token off into a segment of its own and
        # reports the end of the first, which is when the prompt's cache is worth keeping.
        (uid,) = self._generator.insert_segments(
            [[list(prompt)]],
            max_tokens=[max_tokens],
            caches=[cache],
            # BatchGenerator appends to this list as the sequence grows: it must be our own.
            all_tokens=[list(cache_tokens)],
            samplers=[sampler],
        )
        self._uids.add(uid)
        return uid

    def remove(self, uid: int) -> tuple[list[Any], list[int]] | None:
        if uid not in self._uids:
            return None
        self._uids.discard(uid)
        found = self._generator.remove([uid], return_prompt_caches=True).get(uid)
        if found is None:
            return None
        cache, tokens = found
        return list(cache), list(tokens)

    def next(self) -> tuple[list[_Prefilled], list[_Token]]:
        progress, responses = self._generator.next()
        done = [r.uid for r in progress if r.end_of_segment and not r.end_of_prompt]
        prefilled = [
            _Prefilled(uid, list(cache), list(tokens))
            for uid, (cache, tokens) in self._generator.extract_cache(done).items()
        ]
        tokens = []
        for response in responses:
            if response.finish_reason is not None:
                self._uids.discard(response.uid)
            tokens.append(
                _Token(
                    response.uid,
                    response.token,
                    response.finish_reason,
                    response.prompt_cache,
                    response.all_tokens,
                )
            )
        return prefilled, tokens

    def close(self) -> None:
        self._generator.close()


@dataclass(eq=False)
class _SerialSequence:
    uid: int
    prompt: list[int]
    cache: list[Any]
    sampler: Sampler
    max_tokens: int
    produced: int = 0
    steps: Any = None  # the running generate_step generator


class _SerialDecoder:
    """One sequence at a time through `generate_step`, for models that cannot batch."""

    def __init__(self, model: nn.Module, eos_ids: set[int], prefill_step: int) -> None:
        self._model = model
        self._eos_ids = eos_ids
        self._prefill_step = prefill_step
        self._waiting: deque[_SerialSequence] = deque()
        self._current: _SerialSequence | None = None
        self._next_uid = 0

    def __len__(self) -> int:
        return len(self._waiting) + (self._current is not None)

    def insert(
        self,
        prompt: list[int],
        cache: list[Any],
        cache_tokens: list[int],
        sampler: Sampler,
        max_tokens: int,
    ) -> int:
        uid = self._next_uid
        self._next_uid += 1
        self._waiting.append(_SerialSequence(uid, list(prompt), cache, sampler, max_tokens))
        return uid

    def remove(self, uid: int) -> tuple[list[Any], list[int]] | None:
        if self._current is not None and self._current.uid == uid:
            self._current.steps.close()
            self._current = None
            return None
        for sequence in self._waiting:
            if sequence.uid == uid:
                self._waiting.remove(sequence)
                return None
        return None

    def next(self) -> tuple[list[_Prefilled], list[_Token]]:
        import mlx.core as mx
        from mlx_lm.generate import generate_step

        if self._current is None:
            if not self._waiting:
                return [], []
            current = self._waiting.popleft()
            current.steps = generate_step(
                mx.array(current.prompt),
                self._model,
                max_tokens=current.max_tokens,
                sampler=current.sampler,
                prompt_cache=current.cache,
                prefill_step_size=self._prefill_step,
            )
            self._current = current
        current = self._current
        token, _logprobs = next(current.steps)
        current.produced += 1
        finish = None
        if token in self._eos_ids:
            finish = "stop"
        elif current.produced >= current.max_tokens:
            finish = "length"
        if finish is not None:
            current.steps.close()
            self._current = None
        return [], [_Token(current.uid, token, finish)]

    def close(self) -> None:
        if self._current is not None:
            self._current.steps.close()
        self._current = None
        self._waiting.clear()


@dataclass(eq=False)
class _ModelBatch:
    """The jobs of one model: its decoder and the jobs in it, by decoder uid."""

    key: Hashable
    tokenizer: TokenizerWrapper
    decoder: _Decoder
    # Whether this model's caches can go into the prompt cache (plain KVCache layers).
    reusable: bool
    jobs: dict[int, _Job] = field(default_factory=dict)


@dataclass(eq=False)
class _Job:
    job: GenerateJob
    batch: _ModelBatch
    uid: int
    text: _TextStream
    # Tokens generated so far, the resumed ones included (= the next token's position).
    generated: int
    cached_tokens: int


class BatchScheduler:
    """The admitted jobs of a worker, prefilled and decoded in one batch per model.

    Not thread-safe: the worker calls it from its one thread, between steps.
    """

    def __init__(
        self,
        prompt_cache: PromptCache,
        *,
        max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
        prefill_step: int = DEFAULT_PREFILL_STEP,
    ) -> None:
        self.prompt_cache = prompt_cache
        self.max_batch_size = max(1, max_batch_size)
        self.prefill_step = max(1, prefill_step)
        self._jobs: dict[str, _Job] = {}
        self._batches: dict[Hashable, _ModelBatch] = {}

    @property
    def active(self) -> int:
        """Jobs admitted and not yet ended (prefilling or decoding)."""
        return len(self._jobs)

    def __contains__(self, job_id: str) -> bool:
        return job_id in self._jobs

    def job_ids(self) -> list[str]:
        return list(self._jobs)

    # --- jobs ------------------------------------------------------------------------------

    def add(
        self,
        job: GenerateJob,
        model_key: Hashable,
        model: nn.Module,
        tokenizer: TokenizerWrapper,
        prompt_ids: list[int],
    ) -> tuple[int, list[Update]]:
        """Admit `job`; returns its cached prompt tokens and updates that end it right away.

        A job resumed after its final token (EOS, or max_tokens reached) only flushes the text
        still held back and ends; anything else joins its model's batch.
        """
        resumed = list(job.resume_token_ids)
        text = _TextStream(tokenizer, resumed, job.resume_text)
        if resumed and resumed[-1] in tokenizer.eos_token_ids:
            return 0, [Update(job.job_id, [], text.take(final=True), "stop")]
        if len(resumed) >= job.max_tokens:
            return 0, [Update(job.job_id, [], text.take(final=True), "length")]

        from mlx_lm.models.cache import make_prompt_cache

        from jupyter_lmsp.engine.sampling import make_sampler

        batch = self._batch_for(model_key, model, tokenizer)
        context = list(prompt_ids) + resumed
        cache: list[Any] | None = None
        reused = 0
        if batch.reusable:
            # A view of the stored entry (never updated in place; see prompt_cache).
            cache, reused = self.prompt_cache.fetch(model_key, context)
        if cache is None:
            cache = make_prompt_cache(model)
        sampler = make_sampler(job.temperature, job.top_p, job.seed, start_position=len(resumed))
        uid = batch.decoder.insert(
            context[reused:], cache, context[:reused], sampler, job.max_tokens - len(resumed)
        )
        entry = _Job(
            job=job,
            batch=batch,
            uid=uid,
            text=text,
            generated=len(resumed),
            # Usage counts prompt tokens only; a cache may also cover resumed output tokens.
            cached_tokens=min(reused, len(prompt_ids)),
        )
        batch.jobs[uid] = entry
        self._jobs[job.job_id] = entry
        return entry.cached_tokens, []

    def cancel(self, job_id: str) -> int | None:
        """Remove a job at once; returns its generated token count, None if it is not here."""
        entry = self._jobs.pop(job_id, None)
        if entry is None:
            return None
        batch = entry.batch
        batch.jobs.pop(entry.uid, None)
        found = batch.decoder.remove(entry.uid)
        if found is not None:
            # Whatever it holds (part of a prompt, or prompt and output) is a valid prefix.
            self._keep(batch, found[1], found[0])
        self._drop_if_idle(batch)
        return entry.generated

    def cancel_all(self) -> list[tuple[str, int]]:
        """Remove every job; returns (job_id, generated tokens) for each."""
        return [(job_id, self.cancel(job_id) or 0) for job_id in list(self._jobs)]

    # --- stepping --------------------------------------------------------------------------

    def step(self) -> list[Update]:
        """One step of every model's batch: a decode step, then a prefill chunk."""
        updates: list[Update] = []
        for batch in list(self._batches.values()):
            updates.extend(self._step(batch))
            self._drop_if_idle(batch)
        return updates

    def _step(self, batch: _ModelBatch) -> list[Update]:
        try:
            prefilled, tokens = batch.decoder.next()
        except Exception as exc:
            log.exception("generation failed for model %s", batch.key)
            return self._fail_batch(batch, f"{type(exc).__name__}: {exc}")
        for done in prefilled:
            if done.uid in batch.jobs:
                self._keep(batch, done.cache_tokens, done.cache)
        updates = []
        for token in tokens:
            entry = batch.jobs.get(token.uid)
            if entry is not None:
                updates.append(self._advance(entry, token))
        return updates

    def _advance(self, entry: _Job, token: _Token) -> Update:
        job_id = entry.job.job_id
        if token.token in entry.batch.tokenizer.eos_token_ids:
            self._end(entry, token)
            return Update(job_id, [], entry.text.take(final=True), "stop")
        entry.text.add(token.token)
        entry.generated += 1
        if token.finish_reason is not None or entry.generated >= entry.job.max_tokens:
            self._end(entry, token)
            return Update(job_id, [token.token], entry.text.take(final=True), "length")
        return Update(job_id, [token.token], entry.text.take())

    def _end(self, entry: _Job, token: _Token) -> None:
        batch = entry.batch
        self._jobs.pop(entry.job.job_id, None)
        batch.jobs.pop(entry.uid, None)
        if token.finish_reason is None:
            # We ended it before the decoder did; cannot happen while the decoder counts
            # max_tokens as we do, but a job left in the batch would decode forever.
            found = batch.decoder.remove(entry.uid)
            if found is not None:
                self._keep(batch, found[1], found[0])
        elif token.cache is not None and token.cache_tokens is not None:
            self._keep(batch, token.cache_tokens, token.cache)

    # --- batches ---------------------------------------------------------------------------

    def _batch_for(
        self, model_key: Hashable, model: nn.Module, tokenizer: TokenizerWrapper
    ) -> _ModelBatch:
        batch = self._batches.get(model_key)
        if batch is not None:
            return batch
        from mlx_lm.models.cache import make_prompt_cache

        layers = make_prompt_cache(model)
        eos_ids = set(tokenizer.eos_token_ids)
        decoder: _Decoder
        if all(hasattr(layer, "merge") for layer in layers):
            decoder = _BatchDecoder(model, eos_ids, self.max_batch_size, self.prefill_step)
        else:
            log.info("model %s cannot batch; its jobs decode one at a time", model_key)
            decoder = _SerialDecoder(model, eos_ids, self.prefill_step)
        batch = _ModelBatch(model_key, tokenizer, decoder, is_reusable(layers))
        self._batches[model_key] = batch
        return batch

    def _drop_if_idle(self, batch: _ModelBatch) -> None:
        """Let go of a model's batch (and its reference to the model) once it has no jobs."""
        if batch.jobs:
            return
        if self._batches.get(batch.key) is batch:
            del self._batches[batch.key]
            batch.decoder.close()

    def _fail_batch(self, batch: _ModelBatch, message: str) -> list[Update]:
        """A step failed: every job of the model fails (the batch's state is unknown)."""
        failed = list(batch.jobs.values())
        for entry in failed:
            self._jobs.pop(entry.job.job_id, None)
        batch.jobs.clear()
        if self._batches.get(batch.key) is batch:
            del self._batches[batch.key]
        try:
            batch.decoder.close()
        except Exception:
            log.exception("closing a failed decoder")
        return [Update(entry.job.job_id, error=message) for entry in failed]

    def _keep(self, batch: _ModelBatch, tokens: list[int], cache: list[Any]) -> None:
        if not batch.reusable or not tokens:
            return
        try:
            self.prompt_cache.insert(batch.key, tokens, cache)
        except Exception:  # The prompt cache is an optimization: never fail a job over it.
            log.exception("could not keep a prompt cache entry")
