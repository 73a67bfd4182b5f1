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
- `StepCosts`: that cost, learned as the batch runs (the compute of each step, by its shape
  rows x positions, and apart from it the time a call that looked kept the model idle), from
  a prior. Machines differ more than any one prior can say: on the demo model, one core, a
  verify step of one row and 3 draft tokens cost 1.10 ordinary steps with OpenBLAS's Haswell
  kernels (a Zen 3) and 1.45 with its AVX-512 ones (an EPYC); eight rows x 2 positions cost
  1.3 and 1.5-1.65 steps of eight rows. The prior is the dearer machine's, so speculation
  starts only where it pays there, and measured costs take over as verify steps run. How
  much they cost also moves with the machine's load (4 tokens: 1.06 on a quiet machine,
  1.44 at load 6 on 2 cores), which is why they are measured as the batch runs.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# Defaults.
DEFAULT_MAX_DRAFT = 8
# A verify step feeds 1 + max_draft tokens per row; past this, no machine gains.
MAX_DRAFT_LIMIT = 64
# The most rows a step may have and still verify proposals (larger batches decode one token
# per row and step, and do not look for proposals). Measured in the service on the demo
# model, on the AVX-512 EPYC where verifying costs most (bench_speculative, speculation /
# none, median (min-max) over rounds): one stream gained (edits ~2x); four streams gained,
# grounded 1.13x (1.08-1.19), edits 1.09x (1.03-1.30) (results/avx512/speculative_rows4.md);
# eight streams lost in both runs that let them verify, grounded 0.91x (0.85-0.96)
# (speculative.md at 7ff7038), edits 0.92x (0.89-0.95) (speculative_cost_correction.md),
# the second even with the planner's verify costs corrected to what steps of eight rows took:
# the cost model does not see all of what a wide verify of many rows costs the service.
DEFAULT_MAX_ROWS = 4
DEFAULT_MIN_NGRAM = 1
DEFAULT_MAX_NGRAM = 4
# What looking for proposals costs a call (the model idle while it proposes), in ordinary
# steps: 5-7 % measured on the demo model on one core (4.8-7.5 ms of 75-100 ms steps).
DEFAULT_SYNC_COST = 0.06
# The prior of a verify step's compute, in ordinary steps of as many rows: 1 + a x D ** 0.7
# for D draft tokens per row, `a` growing with the rows from `verify_cost[0]` at one row to
# `verify_cost[1]` at eight (and on, linearly, past eight). Measured on the demo model, one
# core, 600 tokens of context, on an AMD EPYC with AVX-512 (one row: D = 1, 3, 7, 15 cost
# 1.22, 1.45, 1.78, 2.49; eight rows: D = 1, 2, 3 cost 1.5-1.65, 1.9-2.1, 2.3-2.4): the
# dearest machine measured, so a machine where verifying is cheaper (a Zen 3 with Haswell
# kernels: one row, D = 3 cost 1.10) starts cautious and learns its own costs as it
# speculates, rather than a machine where it is dear starting by losing.
DEFAULT_VERIFY_COST = (0.22, 0.60)
VERIFY_COST_EXPONENT = 0.7
# The chance a proposed token is accepted (given the ones before it were) before a row has
# verified anything, by the length of the n-gram that matched: 1, 2, 3, 4 (and longer). A
# match of three or four tokens is strong evidence of copying: on the demo model, greedy,
# bench_speculative's prompts, every proposal verified (bench_acceptance.py, results/
# acceptance.md), 3- and 4-grams were accepted at 0.85 and 0.85 (summaries), 0.87 and 0.93
# (edits), 0.91 for 4-grams in stories; 1- and 2-grams at 0.28-0.56 and 0.58-0.65. One prior
# of 0.5 for every length kept eight rows from ever verifying a copying text (a verify of
# eight rows costs 1.6-4.1 steps, results/avx512/step_costs_rows8.md: it pays from a chance
# of ~0.7), so they never learned that it was one.
DEFAULT_ACCEPTANCE_PRIOR = (0.45, 0.55, 0.8, 0.85)


@dataclass(frozen=True)
class SpeculationSettings:
    """How the worker speculates. `enabled` False decodes one token per row per step, exactly
    as without this feature (mlx-lm's own decode step). `max_draft`: the most tokens proposed
    per row and step. `min_ngram`/`max_ngram`: the n-gram lengths looked up. `verify_cost`
    and `sync_cost`: the prior of the cost model (`StepCosts`); a step speculates only when
    the model expects it to make more tokens per second than an ordinary step.
    `acceptance_prior`: a new row's chance of acceptance by matched n-gram length (1, 2, ...;
    the last for longer ones), before its own verifies say otherwise (`Acceptance`).
    `max_rows`: the most rows a step may have and still verify proposals."""

    enabled: bool = True
    max_draft: int = DEFAULT_MAX_DRAFT
    max_rows: int = DEFAULT_MAX_ROWS
    min_ngram: int = DEFAULT_MIN_NGRAM
    max_ngram: int = DEFAULT_MAX_NGRAM
    verify_cost: tuple[float, float] = DEFAULT_VERIFY_COST
    sync_cost: float = DEFAULT_SYNC_COST
    acceptance_prior: tuple[float, ...] = DEFAULT_ACCEPTANCE_PRIOR
    # False: the prior alone, never what steps took (tests use it to make decisions
    # independent of timing).
    learn_costs: bool = True

    def __post_init__(self) -> None:
        if not 0 <= self.max_draft <= MAX_DRAFT_LIMIT:
            raise ValueError(f"max_draft must be in 0..{MAX_DRAFT_LIMIT}, got {self.max_draft}")
        if self.max_rows < 1:
            raise ValueError(f"max_rows must be at least 1, got {self.max_rows}")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(
                f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}"
            )
        if len(self.verify_cost) != 2 or any(c < 0 for c in self.verify_cost):
            raise ValueError(f"verify_cost must be two numbers >= 0, got {self.verify_cost}")
        if self.sync_cost < 0:
            raise ValueError("sync_cost must be >= 0")
        if not self.acceptance_prior or any(not 0 < p < 1 for p in self.acceptance_prior):
            raise ValueError(
                f"acceptance_prior must be chances strictly between 0 and 1, got "
                f"{self.acceptance_prior}"
            )

    def prior_chance(self, ngram: int) -> float:
        """A new row's chance of acceptance for proposals of an `ngram`-token match."""
        table = self.acceptance_prior
        return table[min(max(ngram, 1), len(table)) - 1]

    @property
    def active(self) -> bool:
        return self.enabled and self.max_draft > 0


OFF = SpeculationSettings(enabled=False)


# The `Proposal.ngram` of tokens a row's grammar forces (no n-gram matched them), and their
# prior chance of acceptance (not measured by length like the n-grams': the one prior all
# proposals had before).
FORCED = 0
FORCED_PRIOR = 0.5


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
    proposed in verify steps and accepted, verify steps by width, and by the proposals' n-gram
    length (`FORCED`: a grammar's) the tokens proposed, accepted and the verifies that rejected
    one (`accepted / (accepted + rejected)`: the chance `Acceptance` estimates)."""

    steps: int = 0
    verify_steps: int = 0
    looked: int = 0
    proposed: int = 0
    accepted: int = 0
    widths: dict[int, int] = field(default_factory=dict)
    by_ngram: dict[int, tuple[int, int, int]] = field(default_factory=dict)

    def verified(self, ngram: int, proposed: int, accepted: int) -> None:
        """A row's verify of `proposed` tokens of an `ngram`-token match kept `accepted`."""
        self.proposed += proposed
        self.accepted += accepted
        p, a, r = self.by_ngram.get(ngram, (0, 0, 0))
        self.by_ngram[ngram] = (p + proposed, a + accepted, r + (accepted < proposed))

    def add(self, other: SpeculationStats) -> None:
        self.steps += other.steps
        self.verify_steps += other.verify_steps
        self.looked += other.looked
        self.proposed += other.proposed
        self.accepted += other.accepted
        for width, count in other.widths.items():
            self.widths[width] = self.widths.get(width, 0) + count
        for ngram, counts in other.by_ngram.items():
            mine = self.by_ngram.get(ngram, (0, 0, 0))
            self.by_ngram[ngram] = (mine[0] + counts[0], mine[1] + counts[1], mine[2] + counts[2])


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
    prior with weight `weight`, so a row that stopped speculating tries again: `prior`, one
    chance for every length or one per length. The pooled record (`overall`) starts from the
    best length's: what looking may find before the row has shown what it does find.
    """

    def __init__(
        self,
        lengths: Iterable[int],
        *,
        prior: float | Mapping[int, float] = 0.5,
        weight: float = 2.0,
        decay: float = 0.8,
        relax: float = 0.02,
    ) -> None:
        lengths = list(lengths)
        chances = prior if isinstance(prior, Mapping) else dict.fromkeys(lengths, prior)
        # Per length, and under None all lengths pooled: the row's record whatever it proposes.
        self._prior: dict[int | None, float] = {n: chances[n] for n in lengths}
        self._prior[None] = max(self._prior.values(), default=0.5)
        self.weight = weight
        self.decay = decay
        self.relax = relax
        self._counts: dict[int | None, list[float]] = {
            n: [p * weight, (1 - p) * weight] for n, p in self._prior.items()
        }

    def chance(self, ngram: int) -> float:
        accepted, rejected = self._counts[ngram]
        return accepted / (accepted + rejected)

    def overall(self) -> float:
        """The chance over all the row's recent verifies, whatever n-gram proposed them: what
        looking for a proposal is expected to bring. (Not the best length's: a length that is
        rarely proposed keeps its prior, and a row whose proposals keep failing would look
        for ever on its account.)"""
        accepted, rejected = self._counts[None]
        return accepted / (accepted + rejected)

    def record(self, ngram: int, proposed: int, accepted: int) -> None:
        rejected = 1 if accepted < proposed else 0
        fade = self.decay ** (accepted + rejected)
        for counts in (self._counts[ngram], self._counts[None]):
            # Each trial fades what came before it: the accepted ones, then the rejection.
            counts[0] = counts[0] * fade + sum(
                self.decay**i for i in range(rejected, accepted + rejected)
            )
            counts[1] = counts[1] * fade + rejected

    def idle(self) -> None:
        """A step without a verify of this row: drift back towards the prior."""
        for n, counts in self._counts.items():
            prior = self._prior[n]
            counts[0] += (prior * self.weight - counts[0]) * self.relax
            counts[1] += ((1 - prior) * self.weight - counts[1]) * self.relax


def expected_accepted(chance: float, proposed: int) -> float:
    """Expected accepted tokens of `proposed`, each accepted with `chance` if all before were."""
    if chance >= 1.0:
        return float(proposed)
    return chance * (1 - chance**proposed) / (1 - chance)


class StepCosts:
    """What a step costs, by its shape (rows x positions): learned as the batch runs, from a
    prior.

    Two parts, learned apart:

    - **compute**: the forward pass of a step of `rows` rows x `positions` positions (1: an
      ordinary step; 1 + D: a verify step of D draft tokens). Keyed by the shape, not by the
      tokens fed: eight rows x two positions cost 1.5-1.65 steps of eight rows on the AVX-512
      machine measured, where one row of sixteen tokens costs 1.40 of one of eight. An
      ordinary step is queued before the one in flight is read (mlx-lm's pipeline), so the
      model never waits for Python between two of them.
    - **gap**: what a call costs that *looks* (for proposals, or to resolve a verify step): it
      waits for the step in flight, then proposes and builds the next step while the model has
      nothing to do (a Zen 3 without AVX-512, the demo model: ~10 ms before each dispatch of a
      ~170-ms step).

    `record` takes what a step cost (`spec_batch` times a step queued by a call that looked
    from its dispatch to when the next call found it done, and a step between two pipelined
    calls by the interval between their returns); `record_gap` takes the time a call that
    looked kept the model idle. So verify steps and ordinary ones are both measured, and the
    gap where it happens. `ratio` compares a shape with an ordinary step of as many rows:
    measured when both are (`enough` recent samples each), else the prior (`verify_cost`,
    `sync_cost`).
    """

    def __init__(self, settings: SpeculationSettings, window: int = 9, enough: int = 3) -> None:
        self._settings = settings
        self._window = window
        self._enough = enough
        self._compute: dict[tuple[int, int], deque[float]] = {}
        self._gaps: dict[int, deque[float]] = {}

    def prior(self, rows: int, width: int) -> float:
        """The prior compute of a verify step of `rows` x (1 + `width`) positions, in ordinary
        steps of `rows` rows."""
        if width <= 0:
            return 1.0
        one, eight = self._settings.verify_cost
        slope = one + (eight - one) * (max(rows, 1) - 1) / 7
        return 1.0 + slope * width**VERIFY_COST_EXPONENT

    def _add(self, samples: dict[Any, deque[float]], key: Any, seconds: float) -> None:
        found = samples.get(key)
        if found is None:
            found = samples[key] = deque(maxlen=self._window)
        found.append(seconds)

    def record(self, rows: int, positions: int, seconds: float) -> None:
        """A step of `rows` x `positions` took `seconds` of compute (see the class docstring)."""
        self._add(self._compute, (rows, positions), max(0.0, seconds))

    def record_gap(self, rows: int, seconds: float) -> None:
        """A call on `rows` rows that looked kept the model idle for `seconds`."""
        self._add(self._gaps, rows, max(0.0, seconds))

    def _median(self, samples: dict[Any, deque[float]], key: Any) -> float | None:
        if not self._settings.learn_costs:
            return None
        found = samples.get(key)
        if found is None or len(found) < self._enough:
            return None
        return statistics.median(found)

    def measured(self, rows: int, positions: int) -> float | None:
        """The median compute of the recent steps of this shape, if enough."""
        return self._median(self._compute, (rows, positions))

    def measured_gap(self, rows: int) -> float | None:
        """The median gap of the recent calls on `rows` rows that looked, if enough."""
        return self._median(self._gaps, rows)

    def ratio(self, rows: int, width: int) -> float:
        """A call that looks and queues a step of `rows` x (1 + `width`) positions, in ordinary
        pipelined steps of `rows` rows (`width` 0: an ordinary step after looking)."""
        ordinary = self.measured(rows, 1)
        if ordinary is None or ordinary <= 0:
            return self.prior(rows, width) + self._settings.sync_cost
        wide = self.measured(rows, 1 + width) if width > 0 else ordinary
        compute = wide / ordinary if wide is not None else self.prior(rows, width)
        gap = self.measured_gap(rows)
        return compute + (gap / ordinary if gap is not None else self._settings.sync_cost)


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
    every row in the step, proposal or not (all pay for the step's width); a step of more
    than `settings.max_rows` rows never verifies."""
    if not candidates or rows <= 0 or rows > settings.max_rows:
        return 0
    best, best_rate = 0, float(rows)
    longest = min(settings.max_draft, max(length for length, _ in candidates))
    for width in range(1, longest + 1):
        gain = sum(expected_accepted(p, min(width, n)) for n, p in candidates)
        rate = (rows + gain) / costs.ratio(rows, width)
        if rate > best_rate:
            best, best_rate = width, rate
    return best
