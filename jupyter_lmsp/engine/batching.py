"""Continuous batching for the inference worker: the running jobs of a model decode together.

`BatchScheduler` owns the jobs the worker has admitted. A job has one or more *choices* (n > 1
generates several answers to one prompt); each choice is one row of its model's batch. A job:

1. is admitted (`add`): its context (the prompt, plus the tokens already generated when
   resuming) is looked up in the `PromptCache`, and the longest cached prefix is reused;
2. joins its model's `BatchGenerator` (mlx-lm's continuous batching) with the cached prefix and
   the rest of its context. The generator prefills the prompts waiting together as one batch,
   `prefill_step` tokens each per step, and moves each finished prompt into the decoding batch.
   With n > 1 only the first choice prefills the prompt; the others start from a copy of its
   KV cache once it is read (the prompt is prefilled once), each then decoding its own row;
3. gets one token per choice per `step` until EOS, a stop sequence, the grammar's end,
   max_tokens or a cancel, and each choice leaves the batch as soon as it ends.

Each step is one decode step of the running rows plus one prefill chunk of the waiting ones,
so running jobs keep decoding while prompts are read. While rows decode, the chunk is sized
for its cost (`prefill`: fewer tokens as the context read grows), so a long prompt pauses the
others by about the same at its end as at its start; read alone, a prompt takes full
`prefill_step` chunks. A cancel (handled between steps) takes effect within one step: a row
being decoded is gone before the next decode step, a prompt being read is abandoned before its
next chunk. A step in flight can itself be
abandoned part-way (`interrupt`, at the worker's request, when every job in it is being
cancelled): `abandon` then drops every batch, keeping in the prompt cache the context each
row had read before the step. The KV cache of every prompt, once prefilled, and of every
choice that ends goes into the prompt cache, so concurrent jobs sharing a system prompt and
follow-up turns reuse it.

Per choice, never per row (rows move as jobs join and leave):
- its sampler (`sampling.make_sampler`, seeded with `sampling.choice_seed`, started at its own
  position), which `GenerationBatch` calls once per step on that row; greedy choices share one
  sampler function, which `GenerationBatch` applies to the whole batch at once;
- its text (`stops.TextStream`: detokenizer and stop sequences);
- its grammar (`constraints.Constraint`), the row's logits processor: masks are computed and
  applied only for rows that have one;
- its presence and frequency penalties (`penalties.Penalties`), a logits processor before the
  grammar, counting the tokens the choice generated (resumed ones included); a row with
  penalties does not speculate;
- its thinking budget (`reasoning.ThinkingBudget`), a logits processor between the two that
  forces the thinking block's end marker once the choice has thought `max_reasoning_tokens`
  tokens (resumed ones included); a row with a budget does not speculate either;
- its log-probabilities (`logprobs`), computed after the step from the row's distribution,
  only for jobs that asked for them.

Batched and sequential runs give the same tokens: the batch pads (left for caches, right for
prompt chunks) and masks, and per-row results matched single-sequence runs token for token in
every case tried (tests/test_batching.py; SmolLM2 and the test model, prompts of different
lengths, joined together or staggered, prefill chunks of 16 to 2048).

Speculative decoding (`speculative`, `spec_batch`; on unless `speculation` says otherwise):
the decoding half of a model's batch is `spec_batch.SpeculativeGenerationBatch`, whose steps
may verify tokens proposed from each row's own context, so a step may bring a choice several
tokens (`_Token.drafted` marks the proposed ones kept). They go through `_advance` one by one,
exactly as tokens of consecutive steps would: a stop sequence or max_tokens met on one of them
ends the choice there and the rest are dropped. The tokens are the ones decoding without
speculation gives. Models whose cache layers are not plain `KVCache` do not speculate.

A model whose cache layers cannot be merged into a batch decodes one choice at a time
(`_SerialDecoder`): its prompt is prefilled one chunk per step (so a cancel acts within one
chunk there too), then `mlx_lm.generate.generate_step` decodes it; the others wait their turn.
"""

from __future__ import annotations

import copy
import logging
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from jupyter_lmsp.engine.interrupt import StepAbandoned
from jupyter_lmsp.engine.messages import GenerateJob, TokenLogprob
from jupyter_lmsp.engine.prefill import DEFAULT_BREAK_EVEN, ChunkPacer, chunk_tokens
from jupyter_lmsp.engine.prompt_cache import PromptCache, is_reusable, prefix_view
from jupyter_lmsp.engine.speculative import SpeculationSettings, SpeculationStats, StepCosts
from jupyter_lmsp.engine.stops import StopSequences, TextStream

if TYPE_CHECKING:
    import llguidance
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    from jupyter_lmsp.engine.constraints import Constraint
    from jupyter_lmsp.engine.logprobs import TokenBytes
    from jupyter_lmsp.engine.spec_batch import SpeculativeGenerationBatch
    from jupyter_lmsp.engine.thinking import Thinking

log = logging.getLogger(__name__)

# Rows decoding at once in one worker, unless configured otherwise.
DEFAULT_MAX_BATCH_SIZE = 8
# Prompt tokens per job prefilled in one step. A step prefills this much of every waiting prompt
# at once, so it bounds how long new prompts stall the running jobs (and a cancel waits): one
# 128-token chunk of SmolLM2-135M takes ~0.6 s on one CPU core with OpenBLAS at the start of a
# prompt (further in, chunks beside decoding rows get fewer tokens for the same cost: `prefill`).
# Larger chunks are barely faster on a CPU (128 vs 2048 within noise).
DEFAULT_PREFILL_STEP = 128

Sampler = Callable[["mx.array"], "mx.array"]
LogitsProcessor = Callable[["mx.array", "mx.array"], "mx.array"]


@dataclass
class Update:
    """What one scheduler step produced for one choice of a job.

    `token_ids` holds the new token (none on a final step that ends on EOS: EOS is not output);
    `text` is the text it completed, possibly "" (held back: half a character, or what could
    begin a stop sequence); `logprobs` one entry per token, when the job asked for them. A
    final update has `finish_reason` "stop" (EOS, a stop sequence) or "length" (max_tokens):
    that choice has ended. An update with `error` ends the whole job (tokens sent before it are
    valid); no update for that job follows it.
    """

    job_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    choice: int = 0
    logprobs: list[TokenLogprob] | None = None
    error_code: str = "generation_failed"
    # Of `token_ids`, how many were proposed by speculative decoding and verified.
    drafted: int = 0

    @property
    def final(self) -> bool:
        return self.finish_reason is not None or self.error is not None


@dataclass
class _Token:
    """One decoded token of one sequence; a finished sequence brings its KV cache and tokens."""

    uid: int
    token: int
    finish_reason: str | None
    cache: list[Any] | None = None
    cache_tokens: list[int] | None = None
    # The step's log-probabilities for this row (the model's, after any grammar mask).
    logprobs: mx.array | None = None
    # A proposed token that a verify step kept (speculative decoding).
    drafted: bool = False


@dataclass
class _Prefilled:
    """A segment of a sequence's context is prefilled: its cache, and the tokens it holds."""

    uid: int
    cache: list[Any]
    cache_tokens: list[int]


class _Decoder(Protocol):
    def __len__(self) -> int: ...

    def insert(
        self,
        segments: list[list[int]],
        cache: list[Any],
        cache_tokens: list[int],
        sampler: Sampler,
        processors: list[LogitsProcessor],
        max_tokens: int,
    ) -> int: ...

    def remove(self, uid: int) -> tuple[list[Any], list[int]] | None: ...

    def next(self) -> tuple[list[_Prefilled], list[_Token]]: ...

    def close(self) -> None: ...


class _BatchDecoder:
    """A model's batch: mlx-lm's `BatchGenerator`, prefilling and decoding its sequences.

    `insert` takes a sequence's context as segments: the generator reports the end of each
    (but the last, whose last token it splits off to start decoding) as `_Prefilled`.
    """

    def __init__(
        self,
        model: nn.Module,
        eos_ids: set[int],
        max_batch_size: int,
        prefill_step: int,
        speculation: SpeculationSettings | None = None,
        costs: StepCosts | None = None,
        break_even: int = DEFAULT_BREAK_EVEN,
        pacer: ChunkPacer | None = None,
    ) -> None:
        from mlx_lm.generate import BatchGenerator

        self._generator = BatchGenerator(
            model,
            stop_tokens=[[token] for token in sorted(eos_ids)],
            completion_batch_size=max_batch_size,
            prefill_batch_size=max_batch_size,
            prefill_step_size=prefill_step,
        )
        self.speculative: SpeculativeGenerationBatch | None = None
        if speculation is not None and speculation.active:
            from jupyter_lmsp.engine.spec_batch import SpeculativeGenerationBatch

            # Its decode half, with verify steps (prefill is mlx-lm's, unchanged).
            self.speculative = SpeculativeGenerationBatch(
                model, self._generator.sampler, speculation, eos_ids, costs
            )
            self._generator._generation_batch = self.speculative
        self._uids: set[int] = set()
        self._step = prefill_step
        self._break_even = break_even
        # Chunk sizes corrected by what they cost (`prefill.ChunkPacer`); None: the model's.
        self._pacer = pacer
        # The rows moved into decoding in the last step (their prompts' last token read then).
        self._joined: set[int] = set()
        # The rows whose context is still being read: the positions each had cached when it
        # was inserted, and how many of its context tokens the generator has read since.
        self._reading: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self._uids)

    def insert(
        self,
        segments: list[list[int]],
        cache: list[Any],
        cache_tokens: list[int],
        sampler: Sampler,
        processors: list[LogitsProcessor],
        max_tokens: int,
    ) -> int:
        (uid,) = self._generator.insert_segments(
            [[list(segment) for segment in segments if segment]],
            max_tokens=[max_tokens],
            caches=[cache],
            # BatchGenerator appends to this list as the sequence grows: it must be our own.
            all_tokens=[list(cache_tokens)],
            samplers=[sampler],
            logits_processors=[list(processors)],
        )
        self._uids.add(uid)
        self._reading[uid] = [len(cache_tokens), 0]
        return uid

    def remove(self, uid: int) -> tuple[list[Any], list[int]] | None:
        if uid not in self._uids:
            return None
        self._uids.discard(uid)
        self._reading.pop(uid, None)
        found = self._generator.remove([uid], return_prompt_caches=True).get(uid)
        if found is None:
            return None
        cache, tokens = found
        return list(cache), list(tokens)

    def next(self) -> tuple[list[_Prefilled], list[_Token]]:
        # Read by the generator's step for this step's chunk of every prompt being read.
        chunk = self._chunk()
        self._generator.prefill_step_size = chunk
        if self.speculative is not None:
            # A step that reads prompt tokens (a chunk, or a prompt's last token as it moves
            # into decoding) beside decoding rows verifies no drafts: those rows already wait
            # for one piece of extra work, and a verify step over a long new row's context
            # costs more than a designed chunk (issue 43: the pause that ended with its first
            # token). With no row decoding beside them nobody waits, and a prompt's first
            # step may verify drafts like any other: its first text can come a step sooner.
            reading = self._joined.union(self._reading)
            self.speculative.plain = bool(reading) and not reading.issuperset(self._uids)
        pacer, paced = self._pacer, self._paced()
        started = pacer.clock() if pacer is not None and paced is not None else 0.0
        progress, responses = self._generator.next()
        self._joined = {r.uid for r in progress if r.end_of_prompt}
        if pacer is not None and paced is not None:
            uid, context = paced
            read = next((r.progress[0] for r in progress if r.uid == uid), None)
            if read is not None and not self._joined and read - self._reading[uid][1] == chunk:
                pacer.measured(chunk, context, pacer.clock() - started)
        for r in progress:
            if r.end_of_prompt:
                self._reading.pop(r.uid, None)
            elif r.uid in self._reading:
                self._reading[r.uid][1] = r.progress[0]
        if progress and self.speculative is not None:
            # A prefill chunk was queued behind this step's decode step.
            self.speculative.skip_timing()
        done = [r.uid for r in progress if r.end_of_segment and not r.end_of_prompt]
        prefilled = [
            _Prefilled(uid, list(cache), list(tokens))
            for uid, (cache, tokens) in self._generator.extract_cache(done).items()
        ]
        tokens = []
        for response in responses:
            if response.finish_reason is not None:
                self._uids.discard(response.uid)
                self._reading.pop(response.uid, None)
            tokens.append(
                _Token(
                    response.uid,
                    response.token,
                    response.finish_reason,
                    response.prompt_cache,
                    response.all_tokens,
                    response.logprobs,
                    getattr(response, "drafted", False),
                )
            )
        return prefilled, tokens

    def _chunk(self) -> int:
        """This step's prefill chunk: cost-sized for the longest context being read while
        other rows decode (`prefill`), the full step when no row decodes beside the prompts."""
        if not self._reading or len(self._reading) == len(self._uids):
            return self._step
        context = max(cached + read for cached, read in self._reading.values())
        if self._pacer is not None:
            return self._pacer.tokens(context)
        return chunk_tokens(context, self._step, self._break_even)

    def _paced(self) -> tuple[int, int] | None:
        """The (uid, context) of the one prompt this step reads a chunk of beside decoding
        rows, whose cost the pacer learns from; None when there is none, or several."""
        if len(self._reading) != 1 or len(self._uids) < 2:
            return None
        ((uid, (cached, read)),) = self._reading.items()
        return uid, cached + read

    def close(self) -> None:
        self._generator.close()


@dataclass(eq=False)
class _SerialSequence:
    uid: int
    # The context still to prefill, and where its segments end (positions in `cache_tokens`).
    pending: list[int]
    boundaries: list[int]
    cache: list[Any]
    cache_tokens: list[int]
    sampler: Sampler
    processors: list[LogitsProcessor]
    max_tokens: int
    produced: int = 0
    steps: Any = None  # the running generate_step generator, once prefilled


class _SerialDecoder:
    """One sequence at a time, for models that cannot batch: its context prefilled one chunk
    per `next`, then decoded by `generate_step`."""

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
        segments: list[list[int]],
        cache: list[Any],
        cache_tokens: list[int],
        sampler: Sampler,
        processors: list[LogitsProcessor],
        max_tokens: int,
    ) -> int:
        uid = self._next_uid
        self._next_uid += 1
        pending: list[int] = []
        boundaries = set()
        for segment in segments:
            if segment:
                pending += segment
                boundaries.add(len(cache_tokens) + len(pending))
        # As BatchGenerator does: the end of every segment but the last is reported, and the
        # context's end but for its last token (which starts decoding).
        end = len(cache_tokens) + len(pending)
        boundaries.discard(end)
        boundaries.add(end - 1)
        boundaries.discard(len(cache_tokens))
        self._waiting.append(
            _SerialSequence(
                uid,
                pending,
                sorted(boundaries),
                cache,
                list(cache_tokens),
                sampler,
                list(processors),
                max_tokens,
            )
        )
        return uid

    def remove(self, uid: int) -> tuple[list[Any], list[int]] | None:
        if self._current is not None and self._current.uid == uid:
            if self._current.steps is not None:
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
            self._current = self._waiting.popleft()
        current = self._current
        if current.steps is None and len(current.pending) > 1:
            return self._prefill_chunk(current), []
        if current.steps is None:
            current.steps = generate_step(
                mx.array(current.pending),
                self._model,
                max_tokens=current.max_tokens,
                sampler=current.sampler,
                logits_processors=current.processors or None,
                prompt_cache=current.cache,
                prefill_step_size=self._prefill_step,
            )
        token, logprobs = next(current.steps)
        current.produced += 1
        finish = None
        if token in self._eos_ids:
            finish = "stop"
        elif current.produced >= current.max_tokens:
            finish = "length"
        if finish is not None:
            current.steps.close()
            self._current = None
        return [], [_Token(current.uid, token, finish, logprobs=logprobs)]

    def _prefill_chunk(self, current: _SerialSequence) -> list[_Prefilled]:
        """One chunk of the current sequence's context (never its last token, never across a
        segment's end); the segment's cache if the chunk ended one."""
        import mlx.core as mx

        position = len(current.cache_tokens)
        limit = len(current.pending) - 1
        upcoming = [b - position for b in current.boundaries if b > position]
        if upcoming:
            limit = min(limit, upcoming[0])
        chunk = current.pending[: min(limit, self._prefill_step)]
        self._model(mx.array(chunk)[None], cache=current.cache)
        mx.eval([layer.state for layer in current.cache])
        current.pending = current.pending[len(chunk) :]
        current.cache_tokens += chunk
        if len(current.cache_tokens) not in current.boundaries:
            return []
        # A copy: the sequence goes on updating its own cache.
        snapshot = (
            prefix_view(current.cache, len(current.cache_tokens))
            if is_reusable(current.cache)
            else copy.deepcopy(current.cache)
        )
        return [_Prefilled(current.uid, snapshot, list(current.cache_tokens))]

    def close(self) -> None:
        if self._current is not None and self._current.steps is not None:
            self._current.steps.close()
        self._current = None
        self._waiting.clear()


@dataclass(eq=False)
class _ModelBatch:
    """The jobs of one model: its decoder and the choices in it, by decoder uid."""

    key: Hashable
    model: nn.Module
    tokenizer: TokenizerWrapper
    decoder: _Decoder
    # Whether this model's caches can go into the prompt cache (plain KVCache layers).
    reusable: bool
    rows: dict[int, _Choice] = field(default_factory=dict)


@dataclass(eq=False)
class _Choice:
    job: _Job
    index: int
    text: TextStream
    sampler: Sampler
    constraint: Constraint | None
    resumed: list[int]
    # Tokens generated so far, the resumed ones included (= the next token's position).
    generated: int
    uid: int | None = None  # its decoder row; None while it waits for the prompt, or ended
    ended: bool = False
    # Its presence and frequency penalties (`penalties.Penalties`), None when both are 0.
    penalties: LogitsProcessor | None = None
    # Its thinking budget (`reasoning.ThinkingBudget`), None without one.
    budget: LogitsProcessor | None = None
    # Of the tokens generated here (not the resumed ones), how many speculative decoding
    # proposed and verified.
    drafted: int = 0


@dataclass(eq=False)
class _Job:
    job: GenerateJob
    batch: _ModelBatch
    prompt: list[int]
    cached_tokens: int
    choices: list[_Choice] = field(default_factory=list)
    # Choices waiting for the first one's prompt to be prefilled, to start from its cache.
    waiting: list[_Choice] = field(default_factory=list)
    # The leader's uid while the others wait for it.
    leader_uid: int | None = None
    token_bytes: TokenBytes | None = None

    @property
    def live(self) -> list[_Choice]:
        return [choice for choice in self.choices if not choice.ended]

    @property
    def generated(self) -> int:
        """Tokens generated so far, all choices together."""
        return sum(choice.generated for choice in self.choices)


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
        speculation: SpeculationSettings | None = None,
        prefill_break_even: int = DEFAULT_BREAK_EVEN,
        prefill_pacing: bool = True,
    ) -> None:
        self.prompt_cache = prompt_cache
        self.max_batch_size = max(1, max_batch_size)
        self.prefill_step = max(1, prefill_step)
        # The cost model's K for the chunks read beside decoding rows (`prefill`).
        self.prefill_break_even = max(1, prefill_break_even)
        # Whether chunk sizes follow what chunks cost (`prefill.ChunkPacer`), each model's
        # pacer kept from batch to batch as its step costs are.
        self.prefill_pacing = prefill_pacing
        self._pacers: dict[Hashable, ChunkPacer] = {}
        self.speculation = speculation if speculation is not None else SpeculationSettings()
        # Speculation counters of the batches let go of (see `speculation_stats`), and each
        # model's step costs as learned (a model's batch is let go of whenever it is idle).
        self._spec_stats = SpeculationStats()
        self._step_costs: dict[Hashable, StepCosts] = {}
        self._jobs: dict[str, _Job] = {}
        self._batches: dict[Hashable, _ModelBatch] = {}

    @property
    def active(self) -> int:
        """Jobs admitted and not yet ended (prefilling or decoding)."""
        return len(self._jobs)

    @property
    def load(self) -> int:
        """Choices admitted and not yet ended: the batch rows they take or will take."""
        return sum(len(job.live) for job in self._jobs.values())

    def __contains__(self, job_id: str) -> bool:
        return job_id in self._jobs

    def forget_model(self, model_key: Hashable) -> None:
        """A model was unloaded: drop its prompt-cache entries, learned step and chunk costs."""
        self.prompt_cache.clear(model_key)
        self._step_costs.pop(model_key, None)
        self._pacers.pop(model_key, None)

    def step_costs(self, model_key: Hashable) -> StepCosts | None:
        """What speculative decoding has learned of a model's step costs (None: nothing)."""
        return self._step_costs.get(model_key)

    def speculation_stats(self) -> SpeculationStats:
        """Speculative decoding's counters since this scheduler was made, all models."""
        total = SpeculationStats()
        total.add(self._spec_stats)
        for batch in self._batches.values():
            self._add_stats(total, batch)
        return total

    @staticmethod
    def _add_stats(total: SpeculationStats, batch: _ModelBatch) -> None:
        speculative = getattr(batch.decoder, "speculative", None)
        if speculative is not None:
            total.add(speculative.stats)

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
        grammar: str | llguidance.LLMatcher | None = None,
        thinking: Thinking | None = None,
    ) -> tuple[int, list[Update]]:
        """Admit `job`; returns its cached prompt tokens and updates that end choices at once.

        `grammar` (llguidance's, or its matcher already compiled, which the worker builds off
        its decode loop: `grammar_prep`) constrains every choice. `thinking` (a thinking model's
        markers for this prompt) lets `job.max_reasoning_tokens` close each choice's block. A choice resumed after its end (EOS,
        a stop sequence, max_tokens reached, or a finish reason given) only flushes the text
        still held back and ends; the others join the model's batch. Raises
        `constraints.ConstraintError` if the grammar does not compile for this model or the
        resumed tokens do not follow it (nothing is admitted then).
        """
        from mlx_lm.models.cache import make_prompt_cache

        from jupyter_lmsp.engine.penalties import make_penalties
        from jupyter_lmsp.engine.reasoning import make_budget
        from jupyter_lmsp.engine.sampling import choice_seed, make_sampler

        points = job.resume_points()
        stops = StopSequences(job.stop)
        constraints: list[Constraint | None] = [None] * len(points)
        if grammar is not None:
            from jupyter_lmsp.engine.constraints import Constraint, compile_grammar, ll_tokenizer

            ll = ll_tokenizer(model_key, model, tokenizer)
            # Once per job, copied for each choice.
            compiled = compile_grammar(ll, grammar) if isinstance(grammar, str) else grammar
            constraints = [
                Constraint(ll, compiled.deep_copy(), point.token_ids) for point in points
            ]
        batch = self._batch_for(model_key, model, tokenizer)
        entry = _Job(job, batch, list(prompt_ids), 0)
        if job.logprobs:
            from jupyter_lmsp.engine.constraints import ll_tokenizer
            from jupyter_lmsp.engine.logprobs import TokenBytes

            entry.token_bytes = TokenBytes(ll_tokenizer(model_key, model, tokenizer))
        updates = []
        for i, (point, constraint) in enumerate(zip(points, constraints, strict=True)):
            resumed = list(point.token_ids)
            choice = _Choice(
                entry,
                i,
                TextStream(tokenizer.detokenizer, stops, resumed, point.text),
                make_sampler(job.temperature, job.top_p, choice_seed(job.seed, i), len(resumed)),
                constraint,
                resumed,
                len(resumed),
                # Counted from the resumed tokens: they were generated (see `penalties`).
                penalties=make_penalties(job.presence_penalty, job.frequency_penalty, resumed),
                # Counted from the resumed tokens too: the block may have begun before.
                budget=make_budget(thinking, job.max_reasoning_tokens, resumed),
            )
            entry.choices.append(choice)
            chunk = choice.text.take()
            reason = point.finish_reason
            if reason is None and resumed and resumed[-1] in tokenizer.eos_token_ids:
                reason = "stop"
            if reason is None and choice.text.stopped:
                reason = "stop"
            if reason is None and len(resumed) >= job.max_tokens:
                reason = "length"
            if reason is not None:
                chunk += choice.text.take(final=True)
                choice.ended = True
                updates.append(Update(job.job_id, [], chunk, reason, choice=i))
            elif chunk:
                updates.append(Update(job.job_id, [], chunk, choice=i))
        live = entry.live
        if not live:
            self._drop_if_idle(batch)
            return 0, updates

        leader, followers = live[0], live[1:]
        context = entry.prompt + leader.resumed
        cache: list[Any] | None = None
        reused = 0
        if batch.reusable:
            # A view of the stored entry (never updated in place; see prompt_cache).
            cache, reused = self.prompt_cache.fetch(model_key, context)
        if cache is None:
            cache = make_prompt_cache(model)
        # Usage counts prompt tokens only; a cache may also cover resumed output tokens.
        entry.cached_tokens = min(reused, len(prompt_ids))
        shared = len(prompt_ids) - 1  # what the other choices take from the first one
        if followers and reused < shared:
            segments = [context[reused:shared], context[shared:]]
            entry.waiting = followers
        else:
            segments = [context[reused:]]
            for follower in followers:
                view = prefix_view(cache, shared) if reused else make_prompt_cache(model)
                self._insert(follower, view, entry.prompt[:shared] if reused else [])
        self._insert(leader, cache, context[:reused], segments)
        if entry.waiting:
            entry.leader_uid = leader.uid
        self._jobs[job.job_id] = entry
        return entry.cached_tokens, updates

    def _insert(
        self,
        choice: _Choice,
        cache: list[Any],
        cache_tokens: list[int],
        segments: list[list[int]] | None = None,
    ) -> None:
        """Put a choice into its model's batch; by default its context is what `cache_tokens`
        lacks of its prompt and resumed tokens."""
        entry = choice.job
        if segments is None:
            segments = [(entry.prompt + choice.resumed)[len(cache_tokens) :]]
        # Penalties shift the logits, then a thinking budget may force its end marker, then
        # the grammar masks them (a masked token stays -inf; the grammar allows the marker).
        processors: list[LogitsProcessor] = [
            p for p in (choice.penalties, choice.budget, choice.constraint) if p is not None
        ]
        choice.uid = entry.batch.decoder.insert(
            segments,
            cache,
            cache_tokens,
            choice.sampler,
            processors,
            entry.job.max_tokens - len(choice.resumed),
        )
        entry.batch.rows[choice.uid] = choice

    def cancel(self, job_id: str) -> int | None:
        """Remove a job at once; returns its generated tokens (all choices), None if it is not
        here."""
        entry = self._jobs.pop(job_id, None)
        if entry is None:
            return None
        self._remove_rows(entry)
        self._drop_if_idle(entry.batch)
        return entry.generated

    def cancel_all(self) -> list[tuple[str, int]]:
        """Remove every job; returns (job_id, generated tokens) for each."""
        return [(job_id, self.cancel(job_id) or 0) for job_id in list(self._jobs)]

    def _remove_rows(
        self,
        entry: _Job,
        keep: Callable[[_ModelBatch, list[int], list[Any]], None] | None = None,
    ) -> None:
        """Take the job's rows out of its batch, handing each row's (tokens, cache) to `keep`
        (by default `_keep`)."""
        keep = keep or self._keep
        batch = entry.batch
        entry.waiting = []
        for choice in entry.choices:
            if choice.uid is None:
                continue
            batch.rows.pop(choice.uid, None)
            found = batch.decoder.remove(choice.uid)
            choice.uid = None
            if found is not None:
                # Whatever it holds (part of a prompt, or prompt and output) is a valid prefix.
                keep(batch, found[1], found[0])

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
        except StepAbandoned:
            raise  # not a failure: the caller drops the batch (`abandon`)
        except Exception as exc:
            log.exception("generation failed for model %s", batch.key)
            return self._fail_batch(batch, f"{type(exc).__name__}: {exc}")
        for done in prefilled:
            choice = batch.rows.get(done.uid)
            if choice is None:
                continue
            self._keep(batch, done.cache_tokens, done.cache)
            entry = choice.job
            shared = len(entry.prompt) - 1
            if entry.waiting and done.uid == entry.leader_uid and len(done.cache_tokens) == shared:
                self._start_followers(entry, done)
        updates = []
        logprobs = self._logprobs(batch, tokens)
        for token, logprob in zip(tokens, logprobs, strict=True):
            choice = batch.rows.get(token.uid)
            if choice is not None and not choice.ended and choice.job.job.job_id in self._jobs:
                updates.extend(self._advance(choice, token, logprob))
        return updates

    def _start_followers(self, entry: _Job, done: _Prefilled) -> None:
        """The leader's prompt is prefilled: the other choices start from copies of its cache."""
        followers, entry.waiting, entry.leader_uid = entry.waiting, [], None
        for follower in followers:
            cache = (
                prefix_view(done.cache, len(done.cache_tokens))
                if is_reusable(done.cache)
                else copy.deepcopy(done.cache)
            )
            self._insert(follower, cache, list(done.cache_tokens))

    def _logprobs(self, batch: _ModelBatch, tokens: list[_Token]) -> list[TokenLogprob | None]:
        """The log-probabilities of this step's tokens (a row may have several, speculating),
        for the jobs that asked for them; None for the others."""
        from jupyter_lmsp.engine.logprobs import Wanted, compute

        wanted, names, at = [], [], []
        for i, token in enumerate(tokens):
            choice = batch.rows.get(token.uid)
            if choice is None or token.logprobs is None:
                continue
            job = choice.job.job
            if not job.logprobs or token.token in batch.tokenizer.eos_token_ids:
                continue
            assert choice.job.token_bytes is not None
            wanted.append(
                Wanted(token.logprobs, token.token, job.temperature, job.top_p, job.top_logprobs)
            )
            names.append(choice.job.token_bytes)
            at.append(i)
        found: list[TokenLogprob | None] = [None] * len(tokens)
        if wanted:
            for i, logprob in zip(at, compute(wanted, names), strict=True):
                found[i] = logprob
        return found

    def _advance(
        self, choice: _Choice, token: _Token, logprob: TokenLogprob | None
    ) -> list[Update]:
        entry = choice.job
        job_id = entry.job.job_id
        if choice.constraint is not None and choice.constraint.error is not None:
            return self._fail_job(
                entry, "constraint_failed", f"the grammar matcher failed: {choice.constraint.error}"
            )
        if token.token in entry.batch.tokenizer.eos_token_ids:
            text = choice.text.take(final=True)
            self._end(choice, token)
            return [Update(job_id, [], text, "stop", choice=choice.index)]
        choice.text.add(token.token)
        choice.generated += 1
        choice.drafted += token.drafted
        logprobs = [logprob] if logprob is not None else None
        text = choice.text.take()
        reason = None
        if choice.text.stopped:
            reason = "stop"
        elif token.finish_reason is not None or choice.generated >= entry.job.max_tokens:
            text += choice.text.take(final=True)
            reason = "stop" if choice.text.stopped else "length"
        if reason is not None:
            self._end(choice, token)
        return [
            Update(
                job_id,
                [token.token],
                text,
                reason,
                choice=choice.index,
                logprobs=logprobs,
                drafted=int(token.drafted),
            )
        ]

    def _end(self, choice: _Choice, token: _Token) -> None:
        entry = choice.job
        batch = entry.batch
        choice.ended = True
        if choice.uid is not None:
            batch.rows.pop(choice.uid, None)
            if token.finish_reason is None:
                # We ended it before the decoder did (a stop sequence): out of the batch now.
                found = batch.decoder.remove(choice.uid)
                if found is not None:
                    self._keep(batch, found[1], found[0])
            elif token.cache is not None and token.cache_tokens is not None:
                self._keep(batch, token.cache_tokens, token.cache)
            choice.uid = None
        if not entry.live:
            self._jobs.pop(entry.job.job_id, None)

    def _fail_job(self, entry: _Job, code: str, message: str) -> list[Update]:
        """End a whole job with an error (its other choices too)."""
        self._jobs.pop(entry.job.job_id, None)
        self._remove_rows(entry)
        for choice in entry.choices:
            choice.ended = True
        return [Update(entry.job.job_id, error=message, error_code=code)]

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
            # Speculation needs caches that can forget positions: plain KVCache layers.
            speculation = self.speculation if is_reusable(layers) else None
            costs = None
            if speculation is not None:
                costs = self._step_costs.get(model_key)
                if costs is None:
                    costs = self._step_costs[model_key] = StepCosts(speculation)
            decoder = _BatchDecoder(
                model,
                eos_ids,
                self.max_batch_size,
                self.prefill_step,
                speculation,
                costs,
                self.prefill_break_even,
                self._pacer_for(model_key),
            )
        else:
            log.info("model %s cannot batch; its jobs decode one at a time", model_key)
            decoder = _SerialDecoder(model, eos_ids, self.prefill_step)
        batch = _ModelBatch(model_key, model, tokenizer, decoder, is_reusable(layers))
        self._batches[model_key] = batch
        return batch

    def _pacer_for(self, model_key: Hashable) -> ChunkPacer | None:
        if not self.prefill_pacing:
            return None
        pacer = self._pacers.get(model_key)
        if pacer is None:
            pacer = self._pacers[model_key] = ChunkPacer(self.prefill_step, self.prefill_break_even)
        return pacer

    def _drop_if_idle(self, batch: _ModelBatch) -> None:
        """Let go of a model's batch (and its reference to the model) once it has no jobs."""
        if batch.rows or any(entry.batch is batch for entry in self._jobs.values()):
            return
        if self._batches.get(batch.key) is batch:
            del self._batches[batch.key]
            self._add_stats(self._spec_stats, batch)
            batch.decoder.close()

    def _fail_batch(self, batch: _ModelBatch, message: str) -> list[Update]:
        """A step failed: every job of the model fails (the batch's state is unknown)."""
        failed = self._discard_batch(batch)
        return [Update(entry.job.job_id, error=message) for entry in failed]

    def abandon(self) -> list[tuple[str, int]]:
        """The step in flight was abandoned part-way (`interrupt.StepAbandoned`): drop every
        job and batch; returns (job_id, generated tokens) for each job.

        The batches' caches are part-way through the step: the layers before the
        checkpoint that stopped it hold the step's positions, the others do not. What every
        layer holds (the context read before the step) is a valid prefix and goes into the
        prompt cache, as a cancel between steps keeps it.
        """
        ended = [(job_id, entry.generated) for job_id, entry in self._jobs.items()]
        for entry in list(self._jobs.values()):
            try:
                self._remove_rows(entry, keep=self._keep_common)
            except Exception:  # the prompt cache is an optimization; the batch goes anyway
                log.exception("could not take an abandoned job's cache")
        for batch in list(self._batches.values()):
            self._discard_batch(batch)
        self._jobs.clear()
        return ended

    def _keep_common(self, batch: _ModelBatch, tokens: list[int], cache: list[Any]) -> None:
        """Keep the positions of `tokens` that every layer of `cache` holds."""
        if not batch.reusable or not is_reusable(cache):
            return
        common = min(len(tokens), *(layer.offset for layer in cache))
        if common > 0:
            self._keep(batch, tokens[:common], prefix_view(cache, common))

    def _discard_batch(self, batch: _ModelBatch) -> list[_Job]:
        """Drop a model's batch and its jobs without keeping anything; returns the jobs."""
        dropped = [entry for entry in self._jobs.values() if entry.batch is batch]
        for entry in dropped:
            self._jobs.pop(entry.job.job_id, None)
        batch.rows.clear()
        if self._batches.get(batch.key) is batch:
            del self._batches[batch.key]
            self._add_stats(self._spec_stats, batch)
        try:
            batch.decoder.close()
        except Exception:
            log.exception("closing a discarded decoder")
        return dropped

    def _keep(self, batch: _ModelBatch, tokens: list[int], cache: list[Any]) -> None:
        if not batch.reusable or not tokens:
            return
        try:
            self.prompt_cache.insert(batch.key, tokens, cache)
        except Exception:  # The prompt cache is an optimization: never fail a job over it.
            log.exception("could not keep a prompt cache entry")
