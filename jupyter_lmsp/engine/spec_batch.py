"""Speculative decoding inside continuous batching: a decode batch whose rows verify drafts.

`SpeculativeGenerationBatch` takes the place of mlx-lm's `GenerationBatch` (the decoding half of
`BatchGenerator`; prefill is unchanged). Each step it either

- makes an ordinary decode step: one token per row, the next step queued before this one's
  tokens are read (mlx-lm's own `_step`, unchanged), or
- makes a verify step: each row is fed its current input and the tokens its `NgramDrafter`
  proposes after it (`speculative`), all rows padded to the same width 1 + D; one forward pass
  gives every position's distribution; each position's token is drawn exactly as an ordinary
  step would draw it there (the argmax, or the row's `KeyedSampler` with that position's key);
  a row keeps its proposed tokens up to the first one that differs from the draw, plus the
  draw at that position (the next input), and its KV cache forgets the rest.

So the tokens are the ones an ordinary decode would produce: a proposed token is kept only if
it *is* the token drawn at its position from the model's distribution there. (The verify pass
computes that distribution in a pass of several positions per row; float rounding of the wider
matrix products may differ from a one-position pass in the last bits, as it does between batch
sizes. Exactness is therefore the same as batched vs sequential decoding: identical tokens in
every test and trace tried.)

Which it does is decided per step (`speculative.plan`): only when some row has a proposal and
the expected tokens per second of the verify step, given each row's acceptance record and the
batch's width, beat an ordinary step's. Before looking for proposals at all (which means
waiting for the step in flight instead of queueing the next one) the batch checks that looking
is likely to pay.

Constrained rows (a grammar: `constraints.Constraint`, the row's logits processor) speculate
under their grammar: at each look the batch feeds the matcher what the row kept and its input;
the row proposes the grammar's forced tokens, or else its n-gram proposal cut to the longest
prefix the grammar allows; the verify step masks each of the row's positions with the mask the
matcher gives after the draft tokens before it (`constraints.mask_verify_step`). So every
position's token is drawn from the distribution a one-token step would draw it from, and a
constrained row keeps exactly the tokens it would decode without speculation. Rows that never
speculate: rows with another kind of logits processor (presence and frequency penalties,
`penalties.Penalties`, alone or beside a grammar: they take position 0 of a verify step
only), rows whose sampler cannot draw a given position, and rows with one token left.
Proposals never contain a stop token, so a row can only end on its last token of a step
(max_tokens leaves room for the draw after the drafts).

The batch's KV cache is a `RaggedKVCache`: each row's positions start at 0 (no left padding),
rows may hold different lengths, and a row's length is just a number, so forgetting rejected
positions costs nothing and rows that kept different numbers of tokens stay in one batch
without moving any data. Attention masks each row's queries to its own positions.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import GenerationBatch
from mlx_lm.models.cache import BatchKVCache, KVCache, _BaseCache, dynamic_roll

from jupyter_lmsp.engine.constraints import Constraint, mask_verify_step
from jupyter_lmsp.engine.speculative import (
    FORCED,
    FORCED_PRIOR,
    Acceptance,
    NgramDrafter,
    Proposal,
    SpeculationSettings,
    SpeculationStats,
    StepCosts,
    expected_accepted,
    plan,
)

log = logging.getLogger(__name__)


def _ints(array: mx.array) -> list[int]:
    """A 1-D integer array as Python ints (its `tolist()`; mlx's stub says any nesting)."""
    return cast(list[int], array.tolist())


class RaggedKVCache(_BaseCache):
    """A batch's KV cache for one layer, rows of different lengths, each starting at position 0.

    `lengths` (host integers) is each row's number of positions; `offset` the same as an array
    (the rotary position of a row's next token). New positions of a row are written at its own
    length, and the mask lets a row's query at position p see that row's positions <= p only,
    so what lies past a row's length (other rows are longer, or positions it forgot) is never
    seen and is overwritten later.
    """

    step = 256

    def __init__(self, lengths: Sequence[int] = ()) -> None:
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.lengths = list(lengths)
        self.offset = mx.array(self.lengths, dtype=mx.int32)

    # --- as the model uses it --------------------------------------------------------------

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        batch, heads, n, k_dim = keys.shape
        starts = self.lengths
        end = max(starts) + n
        if self.keys is None or self.values is None or end > self.keys.shape[2]:
            self._grow(batch, heads, k_dim, values.shape[3], end, keys.dtype)
        assert self.keys is not None and self.values is not None
        if all(start == starts[0] for start in starts):
            self.keys[..., starts[0] : starts[0] + n, :] = keys
            self.values[..., starts[0] : starts[0] + n, :] = values
        else:
            at = (mx.array(starts, dtype=mx.int32)[:, None] + mx.arange(n))[:, None, :, None]
            self.keys = mx.put_along_axis(self.keys, at, keys, axis=2)
            self.values = mx.put_along_axis(self.values, at, values, axis=2)
        self.lengths = [start + n for start in starts]
        self.offset = self.offset + n
        return self.keys[..., :end, :], self.values[..., :end, :]

    def _grow(
        self, batch: int, heads: int, k_dim: int, v_dim: int, end: int, dtype: mx.Dtype
    ) -> None:
        have = 0 if self.keys is None else self.keys.shape[2]
        size = ((end + self.step - 1) // self.step) * self.step
        more_k = mx.zeros((batch, heads, size - have, k_dim), dtype)
        more_v = mx.zeros((batch, heads, size - have, v_dim), dtype)
        if self.keys is None or self.values is None:
            self.keys, self.values = more_k, more_v
        else:
            self.keys = mx.concatenate([self.keys, more_k], axis=2)
            self.values = mx.concatenate([self.values, more_v], axis=2)

    def make_mask(
        self, N: int, return_array: bool = False, window_size: int | None = None
    ) -> mx.array | None:
        if window_size is not None:
            raise ValueError("RaggedKVCache has no sliding window")
        lengths = self.lengths
        if N == 1 and not return_array and all(n == lengths[0] for n in lengths):
            return None  # every row sees all its positions and nothing else exists
        width = max(lengths) + N
        queries = self.offset[:, None] + mx.arange(N)  # each query's own position
        mask = mx.arange(width)[None, None, :] <= queries[:, :, None]
        return mask[:, None]  # (rows, 1, N, width), broadcast over heads

    # --- as the batch manages it -----------------------------------------------------------

    def rewind(self, lengths: Sequence[int]) -> None:
        """Forget the positions past `lengths` (each no longer than the row's length now)."""
        self.lengths = list(lengths)
        self.offset = mx.array(self.lengths, dtype=mx.int32)

    @classmethod
    def from_batch(cls, cache: BatchKVCache) -> RaggedKVCache:
        """The same rows as mlx-lm's left-padded `BatchKVCache`, shifted to start at 0."""
        mx.eval(cache.left_padding)
        padding = _ints(cache.left_padding)
        made = cls([cache._idx - p for p in padding])
        if cache.keys is None:
            return made
        keys, values = cache.keys, cache.values
        if any(padding):
            shift = -mx.array(padding, dtype=mx.int32)[:, None]
            keys = dynamic_roll(keys, shift, axis=2)
            values = dynamic_roll(values, shift, axis=2)
        made.keys, made.values = keys, values
        return made

    def filter(self, batch_indices: Sequence[int]) -> None:
        keep = list(batch_indices)
        if self.keys is not None and self.values is not None:
            index = mx.array(keep, dtype=mx.int32)
            self.keys = self.keys[index]
            self.values = self.values[index]
        self.lengths = [self.lengths[i] for i in keep]
        self.offset = mx.array(self.lengths, dtype=mx.int32)

    def extend(self, other: RaggedKVCache) -> None:
        if other.keys is None or other.values is None:
            if other.lengths and any(other.lengths):
                raise ValueError("a cache with positions but no keys")
        elif self.keys is None or self.values is None:
            if self.lengths and any(self.lengths):
                raise ValueError("a cache with positions but no keys")
            self.keys, self.values = other.keys, other.values
        else:
            size = max(self.keys.shape[2], other.keys.shape[2])

            def padded(array: mx.array) -> mx.array:
                missing = size - array.shape[2]
                if missing == 0:
                    return array
                return mx.pad(array, [(0, 0), (0, 0), (0, missing), (0, 0)])

            self.keys = mx.concatenate([padded(self.keys), padded(other.keys)])
            self.values = mx.concatenate([padded(self.values), padded(other.values)])
        self.lengths = self.lengths + other.lengths
        self.offset = mx.array(self.lengths, dtype=mx.int32)

    def extract(self, idx: int, length: int | None = None) -> KVCache:
        """Row `idx`'s first `length` positions (all of them by default) as a `KVCache`."""
        cache = KVCache()
        length = self.lengths[idx] if length is None else min(length, self.lengths[idx])
        if self.keys is not None and self.values is not None and length:
            cache.keys = mx.contiguous(self.keys[idx : idx + 1, :, :length])
            cache.values = mx.contiguous(self.values[idx : idx + 1, :, :length])
            cache.offset = length
        return cache

    @property
    def state(self) -> tuple[Any, ...]:
        return self.keys, self.values, self.offset

    @state.setter
    def state(self, v: tuple[Any, ...]) -> None:
        self.keys, self.values, self.offset = v
        self.lengths = _ints(self.offset)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(n, *self.lengths) if self.lengths else 0
        self.rewind([length - n for length in self.lengths])
        return n

    def size(self) -> int:
        return max(self.lengths, default=0)

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        if self.keys is None or self.values is None:
            return 0
        return int(self.keys.nbytes + self.values.nbytes)


def _grammar_of(processors: Sequence[Any] | None) -> Constraint | None:
    """The row's grammar, if its only logits processor is one (which can take drafts)."""
    if processors and len(processors) == 1 and isinstance(processors[0], Constraint):
        return processors[0]
    return None


@dataclass
class _Row:
    """A row's speculation state: its context's n-gram index and acceptance record, and how
    often looking for a proposal found one (`found`, fading like the acceptance record)."""

    drafter: NgramDrafter
    acceptance: Acceptance
    found: float = 1.0


@dataclass
class _InFlight:
    """A row's part of the verify step in flight: the tokens proposed after its input, the
    n-gram that proposed them (None: the row had no proposal), the tokens drawn at the 1 +
    len(draft) positions and their log-probabilities (lazy until the step is resolved), the
    positions fed (1 + the step's width) and where its sampler was."""

    draft: list[int]
    ngram: int | None
    draws: mx.array
    logprobs: mx.array
    fed: int
    # The row's `KeyedSampler` and the position of its first draw here (None: greedy, or a
    # sampler without positions).
    sampler: Any = None
    position: int | None = None


class SpeculativeGenerationBatch(GenerationBatch):
    """mlx-lm's `GenerationBatch` with verify steps (see the module docstring).

    Its rows come from `extend` with a plain `GenerationBatch` (a prefilled prompt, its first
    step queued), whose left-padded cache is turned into a `RaggedKVCache`. `Response` carries
    `drafted`: whether the token was a proposed token that a verify step kept.

    Like mlx-lm's decode step, every `next()` queues the next forward pass before it returns the
    tokens it has, so the caller's work on them overlaps the model's. An ordinary step queued
    after an ordinary step is mlx-lm's own (`GenerationBatch.next`). Otherwise `next()`:
    1. resolves the verify step in flight, if any: waits for it, keeps each row's accepted
       proposed tokens and forgets the rest of its positions;
    2. with every row's next input known, looks for proposals and queues a verify step or an
       ordinary one;
    3. returns, per row, the accepted proposed tokens and the input it just fed.
    """

    @dataclass
    class Response(GenerationBatch.Response):
        drafted: bool = False

    def __init__(
        self,
        model: nn.Module,
        fallback_sampler: Any,
        settings: SpeculationSettings,
        stop_tokens: Iterable[int] = (),
        costs: StepCosts | None = None,
    ) -> None:
        super().__init__(
            model=model,
            uids=[],
            inputs=mx.array([], dtype=mx.uint32),
            prompt_cache=[],
            tokens=[],
            samplers=[],
            fallback_sampler=fallback_sampler,
            logits_processors=[],
            stop_sequences=[],
            max_tokens=[],
        )
        # mlx-lm allows None for these; this batch always has lists (empty, then grown by
        # `extend`), and queues its own steps' tokens.
        self.samplers: list[Any] = []
        self.logits_processors: list[list[Any]] = []
        self._current_tokens: mx.array | None = None  # type: ignore[assignment]
        self.settings = settings
        self.stop_tokens = frozenset(stop_tokens)
        self.stats = SpeculationStats()
        # The model's step costs (the scheduler keeps them from batch to batch).
        self.costs = costs if costs is not None else StepCosts(settings)
        # The step queued by the last `next()` (rows, positions), when it started (see
        # `_timed`) and whether that call looked.
        self._timing: tuple[int, int, float, bool] | None = None
        self._rows: dict[int, _Row] = {}
        # The verify step in flight, by uid (rows that joined after it was queued have none).
        self._flight: dict[int, _InFlight] = {}
        # Set by the scheduler for a step that shares the model with prompt reading: an
        # ordinary step, no drafts verified (`batching._BatchDecoder.next`).
        self.plain = False

    # --- rows ------------------------------------------------------------------------------

    def extend(self, batch: GenerationBatch) -> None:
        batch.prompt_cache = [
            layer if isinstance(layer, RaggedKVCache) else RaggedKVCache.from_batch(layer)
            for layer in batch.prompt_cache
        ]
        lengths = list(range(self.settings.min_ngram, self.settings.max_ngram + 1))
        processors: Sequence[Any] = batch.logits_processors or [None] * len(batch.uids)
        for uid, tokens, processor in zip(batch.uids, batch.tokens, processors, strict=True):
            drafter = NgramDrafter(
                tokens,
                min_ngram=self.settings.min_ngram,
                max_ngram=self.settings.max_ngram,
                stop_tokens=self.stop_tokens,
            )
            # A constrained row also proposes its grammar's forced tokens: a record of their own.
            prior = {n: self.settings.prior_chance(n) for n in lengths}
            if _grammar_of(processor) is not None:
                prior[FORCED] = FORCED_PRIOR
            self._rows[uid] = _Row(drafter, Acceptance(list(prior), prior=prior))
        super().extend(batch)

    def filter(self, keep: list[int]) -> None:
        super().filter(keep)
        self._rows = {uid: self._rows[uid] for uid in self.uids}
        self._flight = {uid: f for uid, f in self._flight.items() if uid in self._rows}

    def extract_cache(self, idx: int) -> list[Any]:
        # Only the positions of the tokens returned so far: a verify step in flight has fed
        # proposed tokens that may yet be forgotten.
        length = len(self.tokens[idx])
        return [layer.extract(idx, length) for layer in self.prompt_cache]

    # --- steps -----------------------------------------------------------------------------

    def skip_timing(self) -> None:
        """The step queued last shares the model with other work (a prefill chunk queued
        after it): its time says nothing about its cost."""
        self._timing = None

    def _timed(self, rows: int, positions: int, looked: tuple[float, float] | None) -> None:
        """This call queued a step of `rows` x `positions`. `looked`: when it found the step
        in flight done and when it handed its own to MLX, if it looked (the model idle in
        between: the gap); None if it queued its step behind the one in flight (mlx-lm's
        pipeline).

        What the step before cost (see `StepCosts`): if a call that looked queued it, the
        model started it at that call's dispatch, so from then to when this call found it
        done (if this call looked too: a pipelined call never sees that); between two
        pipelined calls the model never idles, so the interval between their returns. Never
        from the return of a call that looked: `async_eval` returns only once most of the
        step has been computed on the CPU, and timing from there measured a verify step of
        one row and 9 positions at 1.2 ordinary steps where it costs 1.95.
        """
        now = time.perf_counter()
        if self._timing is not None:
            last_rows, last_positions, last_start, last_looked = self._timing
            if last_looked and looked is not None:
                self.costs.record(last_rows, last_positions, looked[0] - last_start)
            elif not last_looked and looked is None:
                self.costs.record(last_rows, last_positions, now - last_start)
        if looked is not None:
            ready, dispatched = looked
            self.costs.record_gap(rows, dispatched - ready)
            self._timing = (rows, positions, dispatched, True)
        else:
            self._timing = (rows, positions, now, False)

    def next(self) -> list[GenerationBatch.Response]:
        if not self.uids:
            self._timing = None
            return []
        self.stats.steps += 1
        settings = self.settings
        if self._flight:
            inputs, input_logprobs, kept, ready = self._resolve()
        else:
            # A batch too large to verify (`max_rows`) does not look: looking stalls the
            # pipeline for nothing.
            wide = len(self.uids) > settings.max_rows
            eligible = self._eligible() if settings.active and not wide and not self.plain else []
            if not eligible or not self._worth_looking(eligible):
                for i in eligible:  # not looked at: what it may find drifts back to the prior
                    row = self._rows[self.uids[i]]
                    row.found += (1.0 - row.found) * row.acceptance.relax
                rows = len(self.uids)
                responses = self._ordinary()
                self._timed(rows, 1, None)
                return responses
            # Wait for the step in flight: its tokens are what the proposals continue.
            mx.eval(self._next_tokens)
            ready = time.perf_counter()
            inputs = _ints(self._next_tokens)
            input_logprobs = list(self._next_logprobs)
            kept = [[] for _ in inputs]
        self.stats.looked += 1
        self._begin_grammars(inputs, kept)
        proposals: dict[int, Proposal] = {}
        for i in self._eligible() if settings.active and not self.plain else []:
            row = self._rows[self.uids[i]]
            found = None
            if inputs[i] not in self.stop_tokens:
                row.drafter.sync(self.tokens[i])
                row.drafter.extend(token for token, _ in kept[i])
                # Room for the draft: max_tokens less what is returned now (kept tokens and
                # the input). A row may end on a kept token (max_tokens), never on a stop.
                room = self.max_tokens[i] - self._num_tokens[i] - len(kept[i]) - 1
                limit = min(settings.max_draft, room)
                grammar = _grammar_of(self.logits_processors[i])
                if grammar is None:
                    found = row.drafter.propose(inputs[i], limit)
                else:
                    found = self._grammar_proposal(row, grammar, inputs[i], limit)
            row.found = 0.8 * row.found + 0.2 * (found is not None)
            if found is not None:
                proposals[i] = found
        candidates = [
            (len(p.tokens), self._rows[self.uids[i]].acceptance.chance(p.ngram))
            for i, p in proposals.items()
        ]
        width = plan(candidates, len(self.uids), settings, self.costs)
        if width == 0:
            for row in self._rows.values():
                row.acceptance.idle()
            dispatched = self._queue_ordinary(inputs)
        else:
            dispatched = self._queue_verify(inputs, proposals, width)
        # From the step in flight being done to this one's dispatch, the model had nothing to
        # do. (Not to the return of `async_eval`: on the CPU it returns only once most of the
        # step has been computed.)
        self._timed(len(self.uids), 1 + width, (ready, dispatched))
        return self._emit(inputs, input_logprobs, kept)

    def _begin_grammars(self, inputs: list[int], kept: list[list[tuple[int, mx.array]]]) -> None:
        """Put every constrained row's matcher at the step's first position: feed it the tokens
        the last verify step kept and the input (which its context gets too)."""
        for e, processors in enumerate(self.logits_processors):
            grammar = _grammar_of(processors)
            if grammar is None:
                continue
            tokens = [token for token, _ in kept[e]]
            if tokens:
                self._token_context[e].update_and_fetch(mx.array(tokens, dtype=mx.int32))
            grammar.begin(tokens, inputs[e])

    def _grammar_proposal(
        self, row: _Row, grammar: Constraint, last: int, limit: int
    ) -> Proposal | None:
        """A constrained row's proposal: the tokens its grammar forces, or else its n-gram
        proposal cut to the longest prefix the grammar allows; never a stop token."""
        forced = grammar.forced(limit)
        for j, token in enumerate(forced):
            if token in self.stop_tokens:
                forced = forced[:j]
                break
        found = row.drafter.propose(last, limit)
        if found is not None:
            allowed = grammar.valid_prefix(found.tokens)
            if allowed > len(forced):
                return Proposal(found.tokens[:allowed], found.ngram)
        return Proposal(forced, FORCED) if forced else None

    def _eligible(self) -> list[int]:
        """The rows that may speculate this step."""
        rows = []
        for i, sampler in enumerate(self.samplers):
            processors = self.logits_processors[i] if self.logits_processors else None
            if processors and _grammar_of(processors) is None:
                continue
            if not hasattr(sampler or self.fallback_sampler, "draw"):
                continue
            if self.max_tokens[i] - self._num_tokens[i] < 2:
                continue
            rows.append(i)
        return rows

    def _worth_looking(self, eligible: list[int]) -> bool:
        """Whether looking for proposals is expected to pay: some width D at which the expected
        gain (each row: how often it finds a proposal x its overall acceptance) beats the cost
        of a verify step when anything is found, and of the lost overlap in any case."""
        rows = len(self.uids)
        settings = self.settings
        odds = [self._rows[self.uids[i]] for i in eligible]
        nothing = 1.0
        for row in odds:
            nothing *= 1 - row.found
        looked = self.costs.ratio(rows, 0)
        for width in range(1, settings.max_draft + 1):
            gain = sum(
                row.found * expected_accepted(row.acceptance.overall(), width) for row in odds
            )
            cost = (1 - nothing) * self.costs.ratio(rows, width) + nothing * looked
            if (rows + gain) / cost > rows:
                return True
        return False

    def _ordinary(self) -> list[GenerationBatch.Response]:
        """mlx-lm's decode step: queue the next step on the tokens sampled in flight."""
        for row in self._rows.values():
            row.acceptance.idle()
        return super().next()

    def _resolve(
        self,
    ) -> tuple[list[int], list[mx.array], list[list[tuple[int, mx.array]]], float]:
        """Wait for the verify step in flight; per row: its next input and that token's
        log-probabilities, and the proposed tokens it kept (with theirs); and when the step
        was found done. Rows that joined after the step was queued have their first token in
        `_next_tokens`."""
        flight, self._flight = self._flight, {}
        mx.eval([f.draws for f in flight.values()], self._next_tokens)
        ready = time.perf_counter()
        joined = _ints(self._next_tokens)
        inputs: list[int] = []
        input_logprobs: list[mx.array] = []
        kept: list[list[tuple[int, mx.array]]] = []
        lengths = list(self.prompt_cache[0].lengths)
        for e, uid in enumerate(self.uids):
            f = flight.get(uid)
            if f is None:
                inputs.append(joined[e])
                input_logprobs.append(self._next_logprobs[e])
                kept.append([])
                continue
            drawn = _ints(f.draws)
            accepted = 0
            while accepted < len(f.draft) and drawn[accepted] == f.draft[accepted]:
                accepted += 1
            row = self._rows[uid]
            if f.ngram is not None:
                row.acceptance.record(f.ngram, len(f.draft), accepted)
                self.stats.verified(f.ngram, len(f.draft), accepted)
            else:
                row.acceptance.idle()
            if f.position is not None:
                # It drew positions start .. start + accepted; the next draw is the one after.
                f.sampler.position = f.position + accepted + 1
            kept.append([(f.draft[j], f.logprobs[j]) for j in range(accepted)])
            inputs.append(drawn[accepted])
            input_logprobs.append(f.logprobs[accepted])
            # The step fed the input and the draft (padded to its width): keep the input and
            # the accepted tokens.
            lengths[e] -= f.fed - 1 - accepted
        for layer in self.prompt_cache:
            layer.rewind(lengths)
        return inputs, input_logprobs, kept, ready

    def _process_first(self, fed: mx.array, logits: mx.array) -> list[mx.array]:
        """Each row's logits at its first position, through its logits processors (mlx-lm's
        way: the processor gets the row's token context, the input appended)."""
        return [
            self._process_first_of(e, fed[e : e + 1], logits[e : e + 1])
            for e in range(len(self.uids))
        ]

    def _process_first_of(self, e: int, fed: mx.array, first: mx.array) -> mx.array:
        """Row `e`'s logits (1 x vocab) at its first position through its processors."""
        processors = self.logits_processors[e] or ()
        if processors:
            context = self._token_context[e].update_and_fetch(fed)
            for processor in processors:
                first = processor(context, first)
        return first

    def _process_verify(self, fed: mx.array, logits: mx.array, drafts: list[list[int]]) -> mx.array:
        """A verify step's logits through the rows' processors: a grammar masks each of the
        row's positions (its input's and its draft's), all grammars' at once; another
        processor takes position 0 only (such rows never have a draft). Padding positions
        stay as they are: forgotten."""
        grammars = []
        for e in range(len(self.uids)):
            processors = self.logits_processors[e]
            if not processors:
                continue
            grammar = _grammar_of(processors)
            if grammar is None:
                first = self._process_first_of(e, fed[e : e + 1, 0], logits[e : e + 1, 0])
                logits[e, 0] = first[0]
                continue
            self._token_context[e].update_and_fetch(fed[e : e + 1, 0])
            grammars.append((e, grammar, drafts[e]))
        return mask_verify_step(logits, grammars)

    def _queue_ordinary(self, inputs: list[int]) -> float:
        """mlx-lm's decode step on known inputs (their tokens are emitted by `_emit`); returns
        when it was handed to MLX."""
        fed = mx.array(inputs, dtype=mx.uint32)
        self._current_tokens = fed
        logits = self.model(fed[:, None], cache=self.prompt_cache)[:, -1, :]
        if any(self.logits_processors):
            logits = mx.concatenate(self._process_first(fed, logits), axis=0)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        samplers = [self.fallback_sampler if s is None else s for s in self.samplers]
        if all(s is samplers[0] for s in samplers):
            sampled = samplers[0](logprobs)
        else:
            sampled = mx.concatenate([s(logprobs[e : e + 1]) for e, s in enumerate(samplers)])
        self._next_tokens = sampled
        self._next_logprobs = list(logprobs)
        dispatched = time.perf_counter()
        mx.async_eval(self._next_tokens, self._next_logprobs)
        return dispatched

    def _queue_verify(self, inputs: list[int], proposals: dict[int, Proposal], width: int) -> float:
        """Feed every row its input and its draft, padded to 1 + `width` positions, and draw
        each row's token at each of its positions as an ordinary step would draw it there;
        returns when the step was handed to MLX."""
        count = len(self.uids)
        drafts = [proposals[i].tokens[:width] if i in proposals else [] for i in range(count)]
        # Padding: any valid token id; its positions are forgotten whatever it gives.
        fed = mx.array(
            [
                [inputs[i], *drafts[i]] + [inputs[i]] * (width - len(drafts[i]))
                for i in range(count)
            ],
            dtype=mx.uint32,
        )
        self._current_tokens = fed[:, 0]
        logits = self.model(fed, cache=self.prompt_cache)
        if any(self.logits_processors):
            logits = self._process_verify(fed, logits, drafts)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        samplers = [self.fallback_sampler if s is None else s for s in self.samplers]
        draws = []
        for e, sampler in enumerate(samplers):
            positions = 1 + len(drafts[e])
            start = getattr(sampler, "position", None)
            if not hasattr(sampler, "draw"):
                drawn = sampler(logprobs[e : e + 1, 0])
            else:
                drawn = mx.concatenate(
                    [
                        sampler.draw(logprobs[e : e + 1, j], (start or 0) + j)
                        for j in range(positions)
                    ]
                )
            draws.append(drawn)
            keyed = hasattr(sampler, "draw") and isinstance(start, int)
            self._flight[self.uids[e]] = _InFlight(
                drafts[e],
                proposals[e].ngram if e in proposals else None,
                drawn,
                logprobs[e, :positions],
                1 + width,
                sampler if keyed else None,
                start if keyed else None,
            )
        dispatched = time.perf_counter()
        mx.async_eval(draws, logprobs)
        self.stats.verify_steps += 1
        self.stats.widths[width] = self.stats.widths.get(width, 0) + 1
        return dispatched

    def _emit(
        self,
        inputs: list[int],
        input_logprobs: list[mx.array],
        kept: list[list[tuple[int, mx.array]]],
    ) -> list[GenerationBatch.Response]:
        """The responses of this step: per row its kept proposed tokens, then the input just
        fed; a row ends at its first token that reaches max_tokens or is a stop token."""
        responses: list[GenerationBatch.Response] = []
        ended: list[tuple[int, GenerationBatch.Response]] = []
        keep: list[int] = []
        for e, uid in enumerate(self.uids):
            items = [(token, lp, True) for token, lp in kept[e]]
            items.append((inputs[e], input_logprobs[e], False))
            finish = None
            for token, logprobs, drafted in items:
                self.tokens[e].append(token)
                self._num_tokens[e] += 1
                if self._num_tokens[e] >= self.max_tokens[e]:
                    finish = "length"
                if self._matchers[e].advance(token):
                    finish = "stop"
                response = self.Response(
                    uid=uid,
                    token=token,
                    logprobs=logprobs,
                    finish_reason=finish,
                    prompt_cache=None,
                    all_tokens=None,
                    drafted=drafted,
                )
                responses.append(response)
                if finish is not None:
                    ended.append((e, response))
                    break
            if finish is None:
                keep.append(e)
        for e, last in ended:
            last.prompt_cache = self.extract_cache(e)
            last.all_tokens = self.tokens[e]
        if len(keep) < len(self.uids):
            self.filter(keep)
        return responses
