"""Draft-free speculative decoding: what to propose, and when proposing pays.

No draft model: a row's drafts come from its own context (prompt lookup / n-gram drafting, as
in vLLM's ngram speculation and llama.cpp's lookup decoding). Text that repeats its context (a
summary quoting its source, an edit of a given text, code, a follow-up turn restating the last
one) is proposed for free; `spec_batch.SpeculativeGenerationBatch` verifies the proposal in one
forward pass and keeps the longest prefix the model would have produced itself.

This module is pure Python (no MLX), so it can be tested and reasoned about alone:

- `NgramDrafter`: one row's context and an index of its n-grams (n = `min_ngram` ..
  `max_ngram`); `propose` finds the latest earlier occurrence of the longest n-gram the context
  ends with and proposes the tokens that followed it.
- `Acceptance`: one row's recent record, per n-gram length: the chance that a proposed token
  is accepted given that the ones before it were (a geometric model), and how often a lookup
  finds anything at all. Old evidence fades, and with no new evidence the estimate drifts back
  to the prior, so a row that stopped speculating tries again now and then.
- `plan`: for one step of a batch, how many draft tokens D (0 = an ordinary decode step) make
  the most tokens per second, given every row's proposal and estimate and the cost of feeding
  1 + D tokens to every row (rows share the step's width: a row with fewer drafts is padded).
- `StepCosts`: that cost, learned as the batch runs (the compute of each step, by the tokens
  it fed, and apart from it the time a call that looked kept the model idle), from a prior
  measured on this project's demo model on one CPU core: decode of a small batch reads every
  weight once per step whatever the tokens, so a verify step of 2, 4, 8 or 16 tokens cost 1.09, 1.06-1.10,
  1.4 and 1.9 one-token steps there (3, 5 or 7 tokens cost more than 4 or 8: OpenBLAS's
  kernels take four rows at a time), and a step of 8 rows x 2 tokens 1.3 steps of 8 rows.
  How much verify steps cost moves with the machine's load (4 tokens: 1.06 on a quiet machine,
  1.44 at load 6 on 2 cores), which is why it is measured as the batch runs.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

# Defaults, from the measurements above (the demo model, one CPU core, OpenBLAS).
DEFAULT_MAX_DRAFT = 8
# A verify step feeds 1 + max_draft tokens per row; past this, no machine gains.
MAX_DRAFT_LIMIT = 64
DEFAULT_MIN_NGRAM = 1
DEFAULT_MAX_NGRAM = 4
DEFAULT_SYNC_COST = 0.05
# The cost of a forward pass of n tokens (rows x positions), n = 1 .. 16, in passes of one token:
# the demo model on one core with OpenBLAS (Haswell kernels), 600 tokens of context, medians of
# interleaved runs. Not linear: OpenBLAS's kernels take the tokens four at a time, so 3, 5 or 7
# tokens cost about as much as the next multiple of four. Past the table, each token adds
# DEFAULT_COST_SLOPE.
DEFAULT_STEP_COSTS = (
    1.00, 1.09, 1.33, 1.10, 1.35, 1.40, 1.60, 1.42,
    1.58, 1.75, 1.78, 1.60, 1.95, 2.00, 2.15, 2.00,
)  # fmt: skip
DEFAULT_COST_SLOPE = 0.07


@dataclass(frozen=True)
class SpeculationSettings:
    """How the worker speculates. `enabled` False decodes one token per row per step, exactly
    as without this feature (mlx-lm's own decode step). `max_draft`: the most tokens proposed
    per row and step. `min_ngram`/`max_ngram`: the n-gram lengths looked up. `step_costs`,
    `cost_slope` and `sync_cost`: the prior of the cost model (`StepCosts`); a step speculates
    only when the model expects it to make more tokens per second than an ordinary step."""

    enabled: bool = True
    max_draft: int = DEFAULT_MAX_DRAFT
    min_ngram: int = DEFAULT_MIN_NGRAM
    max_ngram: int = DEFAULT_MAX_NGRAM
    step_costs: tuple[float, ...] = DEFAULT_STEP_COSTS
    cost_slope: float = DEFAULT_COST_SLOPE
    sync_cost: float = DEFAULT_SYNC_COST
    # False: the prior alone, never what steps took (tests use it to make decisions
    # independent of timing).
    learn_costs: bool = True

    def __post_init__(self) -> None:
        if not 0 <= self.max_draft <= MAX_DRAFT_LIMIT:
            raise ValueError(f"max_draft must be in 0..{MAX_DRAFT_LIMIT}, got {self.max_draft}")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(
                f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}"
            )
        if not self.step_costs or any(c <= 0 for c in self.step_costs):
            raise ValueError("step_costs must be positive")
        if self.cost_slope < 0 or self.sync_cost < 0:
            raise ValueError("cost_slope and sync_cost must be >= 0")

    @property
    def active(self) -> bool:
        return self.enabled and self.max_draft > 0


OFF = SpeculationSettings(enabled=False)


# The `Proposal.ngram` of tokens a row's grammar forces (no n-gram matched them).
FORCED = 0


@dataclass
class Proposal:
    """Tokens proposed for the positions after a row's current input, and the length of the
    n-gram that matched (which `Acceptance` keeps its record by), or `FORCED`: tokens the
    row's grammar forces."""

    tokens: list[int]
    ngram: int


@dataclass
class SpeculationStats:
    """Counters of a batch's steps: all, verify steps, steps that looked for proposals, tokens
    proposed in verify steps and accepted, and verify steps by width."""

    steps: int = 0
    verify_steps: int = 0
    looked: int = 0
    proposed: int = 0
    accepted: int = 0
    widths: dict[int, int] = field(default_factory=dict)

    def add(self, other: SpeculationStats) -> None:
        self.steps += other.steps
        self.verify_steps += other.verify_steps
        self.looked += other.looked
        self.proposed += other.proposed
        self.accepted += other.accepted
        for width, count in other.widths.items():
            self.widths[width] = self.widths.get(width, 0) + count


class NgramDrafter:
    """One row's context and, for each n-gram length, where each n-gram last occurred with a
    token after it. Appending a token is O(number of lengths); a lookup is one dict probe per
    length, longest first."""

    def __init__(
        self,
        tokens: Iterable[int] = (),
        *,
        min_ngram: int = DEFAULT_MIN_NGRAM,
        max_ngram: int = DEFAULT_MAX_NGRAM,
        stop_tokens: Iterable[int] = (),
    ) -> None:
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        self.stop_tokens = frozenset(stop_tokens)
        self.tokens: list[int] = []
        # continuation[n][ngram] = the index of the token that followed its latest occurrence.
        self._continuation: dict[int, dict[tuple[int, ...], int]] = {
            n: {} for n in range(min_ngram, max_ngram + 1)
        }
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        for token in tokens:
            self.append(token)

    def append(self, token: int) -> None:
        tokens = self.tokens
        at = len(tokens)
        tokens.append(token)
        # The n-grams that end just before the new token now have a continuation: it.
        for n, table in self._continuation.items():
            if at >= n:
                table[tuple(tokens[at - n : at])] = at

    def sync(self, tokens: Sequence[int]) -> None:
        """Catch up with `tokens`, the row's context, of which ours is a prefix."""
        if len(tokens) > len(self.tokens):
            self.extend(tokens[len(self.tokens) :])

    def propose(self, last: int, limit: int) -> Proposal | None:
        """Up to `limit` tokens to follow the context + `last` (the row's current input, not yet
        part of the context), copied from after the latest earlier occurrence of the longest
        n-gram the context + `last` ends with. Never proposes a stop token (nor what follows
        one): a row must end where the model says so. None if nothing matches."""
        if limit <= 0:
            return None
        tokens = self.tokens
        for n in range(min(self.max_ngram, len(tokens) + 1), self.min_ngram - 1, -1):
            key = (*tokens[len(tokens) - n + 1 :], last) if n > 1 else (last,)
            start = self._continuation[n].get(key)
            if start is None:
                continue
            draft = tokens[start : start + limit]
            if len(draft) < limit and start + len(draft) == len(tokens):
                # The match runs into the end of the context: `last` comes next.
                draft.append(last)
            for i, token in enumerate(draft):
                if token in self.stop_tokens:
                    draft = draft[:i]
                    break
            if draft:
                return Proposal(draft, n)
            return None
        return None


class Acceptance:
    """A row's recent acceptance record, one per n-gram length.

    Per length: `accepted` and `rejected` counts. A verify that kept a of d proposed tokens
    made a + 1 trials (a + 0 if it kept them all): a accepted, one rejected; every trial first
    fades the counts by `decay`, so the record is the last few trials' (~1 / (1 - decay)) and
    follows the text as it changes (a quote ends, copying stops). `chance` = accepted /
    (accepted + rejected): the chance a proposed token is accepted given the ones before it
    were. Both counts start from, and drift back to (`relax` per step without a verify), a
    prior of `prior` with weight `weight`, so a row that stopped speculating tries again.
    """

    def __init__(
        self,
        lengths: Iterable[int],
        *,
        prior: float = 0.5,
        weight: float = 2.0,
        decay: float = 0.8,
        relax: float = 0.02,
    ) -> None:
        self.prior = prior
        self.weight = weight
        self.decay = decay
        self.relax = relax
        self._counts = {n: [prior * weight, (1 - prior) * weight] for n in lengths}

    def chance(self, ngram: int) -> float:
        accepted, rejected = self._counts[ngram]
        return accepted / (accepted + rejected)

    def best(self) -> float:
        return max(self.chance(n) for n in self._counts)

    def record(self, ngram: int, proposed: int, accepted: int) -> None:
        counts = self._counts[ngram]
        rejected = 1 if accepted < proposed else 0
        fade = self.decay ** (accepted + rejected)
        # Each trial fades what came before it: the accepted ones, then the rejection.
        counts[0] = counts[0] * fade + sum(
            self.decay**i for i in range(rejected, accepted + rejected)
        )
        counts[1] = counts[1] * fade + rejected

    def idle(self) -> None:
        """A step without a verify of this row: drift back towards the prior."""
        for counts in self._counts.values():
            counts[0] += (self.prior * self.weight - counts[0]) * self.relax
            counts[1] += ((1 - self.prior) * self.weight - counts[1]) * self.relax


def expected_accepted(chance: float, proposed: int) -> float:
    """Expected accepted tokens of `proposed`, each accepted with `chance` if all before were."""
    if chance >= 1.0:
        return float(proposed)
    return chance * (1 - chance**proposed) / (1 - chance)


class StepCosts:
    """What a step costs, by the tokens it feeds: learned as the batch runs, from a prior.

    Two parts, learned apart:

    - **compute**: the forward pass of a step of n tokens (rows x positions). An ordinary step
      is queued before the one in flight is read (mlx-lm's pipeline), so the model never
      waits for Python between two of them.
    - **gap**: what a call costs that *looks* (for proposals, or to resolve a verify step): it
      waits for the step in flight, then proposes and builds the next step while the model has
      nothing to do. On a fast CPU the gap is a few percent of a step; on a slow one it
      decides whether speculating pays (a Zen 3 without AVX-512, the demo model: ~10 ms
      before each dispatch of a ~170-ms step, and a step that waited first took 1.04-1.21x
      one that did not).

    `record` takes the seconds between the returns of two consecutive calls less the gap of
    the second (which, if it looked, it spent before queueing its step): what the step in
    flight between them cost. `record_gap` takes that gap. So every step measures the compute
    of its width whether or not the calls around it looked (a batch that speculates all along
    still knows what an ordinary step costs), and the gap is measured where it happens.
    Before enough samples, both come from the prior (`step_costs`, `cost_slope` and
    `sync_cost`, in one-token steps), scaled as the measured steps compare with theirs.
    """

    def __init__(self, settings: SpeculationSettings, window: int = 9, enough: int = 3) -> None:
        self._settings = settings
        self._window = window
        self._enough = enough
        self._compute: dict[int, deque[float]] = {}
        self._gaps: dict[int, deque[float]] = {}

    def prior(self, tokens: int) -> float:
        """The prior compute cost of a step of `tokens` tokens, in one-token steps."""
        table = self._settings.step_costs
        if tokens <= len(table):
            return table[tokens - 1]
        return table[-1] + self._settings.cost_slope * (tokens - len(table))

    def _add(self, samples: dict[int, deque[float]], key: int, seconds: float) -> None:
        found = samples.get(key)
        if found is None:
            found = samples[key] = deque(maxlen=self._window)
        found.append(seconds)

    def record(self, tokens: int, seconds: float) -> None:
        """A step of `tokens` tokens took `seconds` of compute (see the class docstring)."""
        self._add(self._compute, tokens, max(0.0, seconds))

    def record_gap(self, rows: int, seconds: float) -> None:
        """A call on `rows` rows that looked kept the model idle for `seconds`."""
        self._add(self._gaps, rows, max(0.0, seconds))

    def _median(self, samples: dict[int, deque[float]], key: int) -> float | None:
        if not self._settings.learn_costs:
            return None
        found = samples.get(key)
        if found is None or len(found) < self._enough:
            return None
        return statistics.median(found)

    def measured(self, tokens: int) -> float | None:
        """The median compute of the recent steps of `tokens` tokens, if enough."""
        return self._median(self._compute, tokens)

    def measured_gap(self, rows: int) -> float | None:
        """The median gap of the recent calls on `rows` rows that looked, if enough."""
        return self._median(self._gaps, rows)

    def cost(self, tokens: int) -> float:
        """A step's compute in seconds: measured, or the prior scaled by how the measured steps
        compare with theirs (in prior units when nothing is measured yet)."""
        found = self.measured(tokens)
        if found is not None:
            return found
        return self.prior(tokens) * self._scale()

    def gap(self, rows: int) -> float:
        """What looking costs a call on `rows` rows, in seconds (or prior units)."""
        found = self.measured_gap(rows)
        if found is not None:
            return found
        return self._settings.sync_cost * self._scale()

    def _scale(self) -> float:
        if not self._settings.learn_costs:
            return 1.0
        scales = [
            found / self.prior(tokens)
            for tokens in self._compute
            if (found := self.measured(tokens)) is not None
        ]
        return statistics.median(scales) if scales else 1.0

    def ratio(self, rows: int, width: int) -> float:
        """A call that looks and queues a step of `rows` x (1 + `width`) tokens, in ordinary
        pipelined steps of `rows` tokens (`width` 0: an ordinary step after looking)."""
        return (self.cost(rows * (1 + width)) + self.gap(rows)) / self.cost(rows)


def plan(
    candidates: Sequence[tuple[int, float]],
    rows: int,
    settings: SpeculationSettings,
    costs: StepCosts,
) -> int:
    """The draft length D of one step: 0 (an ordinary step) or the D that maximizes expected
    tokens per unit of time, (rows + expected accepted) / costs.ratio(rows, D), if that beats
    an ordinary step (rows per unit).

    `candidates` has one (proposed tokens, chance) pair per row with a proposal; `rows` counts
    every row in the step, proposal or not (all pay for the step's width)."""
    if not candidates or rows <= 0:
        return 0
    best, best_rate = 0, float(rows)
    longest = min(settings.max_draft, max(length for length, _ in candidates))
    for width in range(1, longest + 1):
        gain = sum(expected_accepted(p, min(width, n)) for n, p in candidates)
        rate = (rows + gain) / costs.ratio(rows, width)
        if rate > best_rate:
            best, best_rate = width, rate
    return best
