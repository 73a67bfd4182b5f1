"""Speculative decoding (`engine.speculative`, `engine.spec_batch`): it changes no token.

Pure parts first: the n-gram drafter, the acceptance record, the step planner and the learned
step costs. Then the ragged KV cache against single-sequence caches, and the scheduler on the
test model, in this process: speculation on (its real, adaptive settings) and *forced* (a verify
step whenever a row has a proposal, whatever it costs, so rejections, rollbacks and rows
keeping different numbers of tokens happen on nearly every step) give exactly the tokens, text,
finish reasons and log-probabilities of speculation off: greedy and seeded, one job and a
batch, n choices, stop sequences and max_tokens landing inside a verify step, grammar rows
beside speculating rows, resumed jobs at every point, jobs joining and leaving while a verify
step is in flight. Through the worker process: the accepted draft tokens are reported, the
demo model on a grounded workload gives the same text with and without speculation, and the
worker's settings turn it off.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from schedrun import CHAT, FORCED, Result, add, collect, job, run, scheduler, streamed_text

from jupyter_lmsp.engine.messages import WorkerSettings
from jupyter_lmsp.engine.speculative import (
    DEFAULT_ACCEPTANCE_PRIOR,
    DEFAULT_MAX_ROWS,
    OFF,
    Acceptance,
    NgramDrafter,
    SpeculationSettings,
    StepCosts,
    expected_accepted,
    plan,
)

pytestmark = pytest.mark.timeout(300)

# Settings that let eight rows verify (the default `max_rows` does not), for the tests of the
# cost model and the planner at eight rows.
EIGHT = SpeculationSettings(max_rows=8)
SEEDED = {"temperature": 0.5, "top_p": 0.9, "seed": 1234}
QUESTIONS = [
    "Tell me about the café on the corner.",
    "Why?",
    "Summarise: the server streams events to every client that is watching.",
    "A task can be cancelled, resumed after a crash, or left to finish. Explain.",
]


def chat(question: str) -> list[dict[str, str]]:
    return [CHAT[0], {"role": "user", "content": question}]


# --- the drafter ------------------------------------------------------------------------------


def test_the_drafter_proposes_what_followed_the_latest_longest_match() -> None:
    #          0  1  2  3  4  5  6  7  8  9
    context = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8]
    drafter = NgramDrafter(context, min_ngram=1, max_ngram=3)
    # The context + 2 ends with no 2- or 3-gram seen before; "2" was last followed by 3, 7, 8.
    found = drafter.propose(2, limit=3)
    assert found is not None and found.ngram == 1 and found.tokens == [3, 7, 8]
    # The longest n-gram first: "1 2 3" (0..2) rather than "3" alone; the copy runs into the
    # end of the context and goes on with the input itself.
    drafter = NgramDrafter([1, 2, 3, 4, 5, 6, 1, 2], min_ngram=1, max_ngram=3)
    found = drafter.propose(3, limit=10)
    assert found is not None and found.ngram == 3
    assert found.tokens == [4, 5, 6, 1, 2, 3]
    found = drafter.propose(3, limit=2)
    assert found is not None and found.tokens == [4, 5]
    assert drafter.propose(99, limit=5) is None
    assert drafter.propose(3, limit=0) is None


def test_the_drafter_never_proposes_a_stop_token_and_follows_its_context() -> None:
    drafter = NgramDrafter([5, 6, 7, 0, 8, 5], min_ngram=2, max_ngram=2, stop_tokens={0})
    found = drafter.propose(6, limit=5)  # "5 6" was followed by 7, then the stop token 0
    assert found is not None and found.tokens == [7]
    assert (
        NgramDrafter([5, 6, 0, 5], min_ngram=2, max_ngram=2, stop_tokens={0}).propose(6, 4) is None
    )
    # Below min_ngram nothing matches; appended tokens join the index.
    drafter = NgramDrafter([1, 2, 3], min_ngram=2, max_ngram=3)
    assert drafter.propose(9, 4) is None
    drafter.extend([9, 4])
    drafter.sync([1, 2, 3, 9, 4, 1])  # catches up with the row's context
    assert len(drafter) == 6
    found = drafter.propose(2, 4)  # "1 2" at 0..1 was followed by 3, 9, 4, 1
    assert found is not None and found.tokens == [3, 9, 4, 1]


def test_the_acceptance_record_follows_recent_verifies_and_drifts_back() -> None:
    record = Acceptance([1, 2], prior=0.5, weight=2.0, decay=0.8, relax=0.05)
    assert record.chance(1) == record.chance(2) == 0.5
    for _ in range(10):
        record.record(2, proposed=8, accepted=8)
        record.record(1, proposed=4, accepted=0)
    assert record.chance(2) > 0.95 and record.chance(1) < 0.05
    # Overall (what looking is expected to bring): all verifies pooled, whatever proposed them.
    assert record.chance(1) < record.overall() < record.chance(2)
    # A row whose proposals keep failing: overall follows them, though a length never
    # proposed still holds its prior (a story: looking stops paying).
    story = Acceptance([1, 2, 3], prior=0.5, weight=2.0, decay=0.8, relax=0.05)
    for _ in range(6):
        story.record(1, proposed=3, accepted=0)
    assert story.chance(3) == 0.5 and story.overall() == story.chance(1) < 0.15
    # Proposals of length 2 start failing: the estimate follows within a few verifies, however
    # many tokens the earlier ones kept.
    for _ in range(8):
        record.record(2, proposed=8, accepted=0)
    assert record.chance(2) < 0.35
    # Without verifies, back towards the prior: a row that stopped speculating tries again.
    before = record.chance(1)
    for _ in range(100):
        record.idle()
    assert before < record.chance(1) and abs(record.chance(1) - 0.5) < 0.05


def test_a_new_rows_chance_starts_from_its_match_lengths_prior() -> None:
    """A three- or four-token match is copying more often than not: a new row starts from the
    prior of the length that matched, drifts back to it, and looks as its best length would
    find (the pooled record starts from the best length's prior)."""
    settings = SpeculationSettings(acceptance_prior=(0.4, 0.5, 0.8, 0.9))
    assert [settings.prior_chance(n) for n in (1, 2, 3, 4, 6)] == [0.4, 0.5, 0.8, 0.9, 0.9]
    prior = {n: settings.prior_chance(n) for n in (1, 2, 3, 4)}
    record = Acceptance(list(prior), prior=prior, relax=0.05)
    assert record.chance(1) == 0.4 and record.chance(4) == 0.9 and record.overall() == 0.9
    for _ in range(6):
        record.record(4, proposed=4, accepted=0)
    assert record.chance(4) < 0.3 and record.chance(3) == 0.8
    for _ in range(200):
        record.idle()
    assert abs(record.chance(4) - 0.9) < 0.01 and abs(record.overall() - 0.9) < 0.01
    for bad in [(), (0.5, 1.0), (0.0,)]:
        with pytest.raises(ValueError, match="acceptance_prior"):
            SpeculationSettings(acceptance_prior=bad)


def test_eight_new_rows_verify_a_four_token_match_by_the_prior() -> None:
    """Eight rows pay 1.6-4.1 steps for a verify: with one prior of 0.5 for every match they
    never verified, so never learned that their text was a copy. By the default priors, eight
    4-gram matches are verified and eight 1-gram matches are not."""
    settings = EIGHT
    costs = StepCosts(settings)
    four, one = settings.prior_chance(4), settings.prior_chance(1)
    assert plan([(8, four)] * 8, 8, settings, costs) >= 2
    assert plan([(8, one)] * 8, 8, settings, costs) == 0
    assert plan([(8, 0.5)] * 8, 8, settings, costs) == 0


def test_batches_larger_than_max_rows_never_verify() -> None:
    """Eight streams lost with speculation in the service on the machine where verifying
    costs most, so by default a step of more than `max_rows` rows decodes one token per row:
    proposals that would pay by the cost model are not verified there."""
    settings = SpeculationSettings()
    assert settings.max_rows == DEFAULT_MAX_ROWS < 8
    rows = settings.max_rows
    costs = StepCosts(settings)
    sure = [(8, 0.99)]
    assert plan(sure * rows, rows, settings, costs) > 0
    assert plan(sure * (rows + 1), rows + 1, settings, costs) == 0
    assert plan(sure * 8, 8, EIGHT, costs) > 0


def test_the_planner_speculates_only_when_it_pays() -> None:
    settings = EIGHT
    costs = StepCosts(settings)
    assert plan([], 1, settings, costs) == 0
    # One row, proposals that are usually right: wide steps.
    assert plan([(8, 0.9)], 1, settings, costs) >= 4
    # Proposals that are usually wrong cost more than they bring.
    assert plan([(8, 0.05)], 1, settings, costs) == 0
    # Eight rows pay for every row's width: one good proposal among them does not pay...
    assert plan([(8, 0.6)], 8, settings, costs) == 0
    # ...nor eight that are right a bit more than half the time, at the prior's costs (eight
    # rows x 2 positions: 1.66 steps of eight rows)...
    assert plan([(8, 0.6)] * 8, 8, settings, costs) == 0
    # ...but eight that are nearly always right do.
    assert plan([(8, 0.95)] * 8, 8, settings, costs) >= 1
    assert expected_accepted(1.0, 5) == 5.0
    assert abs(expected_accepted(0.5, 2) - 0.75) < 1e-12
    assert plan([(8, 0.9)], 1, SpeculationSettings(max_draft=2), costs) <= 2


def test_step_costs_are_learned_from_the_steps_taken() -> None:
    settings = SpeculationSettings()
    costs = StepCosts(settings)
    # The prior: a verify step of D tokens costs 1 + a x D ** 0.7 ordinary steps, `a` growing
    # with the rows; looking adds `sync_cost`.
    one, eight = settings.verify_cost
    prior = 1 + one * 3**0.7 + settings.sync_cost
    assert costs.ratio(1, 3) == pytest.approx(prior)
    assert costs.ratio(8, 1) == pytest.approx(1 + eight + settings.sync_cost)
    assert costs.ratio(1, 0) == pytest.approx(1 + settings.sync_cost)
    for seconds in (0.10, 0.11, 0.09, 5.0):  # one outlier (a stall) among them
        costs.record(1, 1, seconds)
    assert costs.measured(1, 1) == pytest.approx(0.105)
    # The wide step is not measured yet: the prior.
    assert costs.ratio(1, 3) == pytest.approx(prior)
    # Four tokens in four rows are not four positions of one row: shapes are kept apart.
    for seconds in (0.30, 0.31, 0.29):
        costs.record(4, 1, seconds)
    assert costs.ratio(1, 3) == pytest.approx(prior)
    for seconds in (0.30, 0.31, 0.29):
        costs.record(1, 4, seconds)
    assert costs.ratio(1, 3) == pytest.approx(0.30 / 0.105 + settings.sync_cost)
    # The gap of a call that looked, once measured, is what looking costs.
    for seconds in (0.03, 0.02, 0.04):
        costs.record_gap(1, seconds)
    assert costs.ratio(1, 3) == pytest.approx((0.30 + 0.03) / 0.105)
    assert costs.ratio(1, 0) == pytest.approx((0.105 + 0.03) / 0.105)
    # Other row counts keep their prior until measured.
    assert costs.ratio(8, 1) == pytest.approx(1 + eight + settings.sync_cost)
    fixed = StepCosts(SpeculationSettings(learn_costs=False))
    for seconds in (0.1, 0.1, 0.1):
        fixed.record(1, 1, seconds)
        fixed.record(1, 4, seconds * 9)
        fixed.record_gap(1, seconds)
    assert fixed.ratio(1, 3) == pytest.approx(prior)


def test_measured_costs_turn_speculation_on_where_verifying_is_cheap() -> None:
    """The prior is the dearer machine's: eight rows right 60 % of the time do not speculate
    on it; once verify steps of eight rows are measured cheap (a machine with Haswell
    kernels: 1.3 steps), they do, and where they are measured dear, they stop."""
    settings = EIGHT
    rows = [(8, 0.6)] * 8
    for verify, speculates in ((0.13, True), (0.17, False)):
        costs = StepCosts(settings)
        assert plan(rows, 8, settings, costs) == 0
        for _ in range(3):
            costs.record(8, 1, 0.100)
            costs.record(8, 2, verify)
            costs.record_gap(8, 0.003)
        assert (plan(rows, 8, settings, costs) > 0) is speculates


def test_a_step_queued_by_a_call_that_looked_is_timed_from_its_dispatch() -> None:
    """`async_eval` returns only once most of a step is computed on the CPU: timing a verify
    step from the return of the call that queued it measured a fraction of it (one row, 9
    positions: 1.2 ordinary steps where it costs 1.95). It is timed from its dispatch to when
    the next call found it done; a pipelined call (which never sees when the step before was
    done) times nothing after a call that looked, nor does a call that looked after a
    pipelined one; two pipelined calls time the interval between their returns."""
    import time
    from types import SimpleNamespace

    from jupyter_lmsp.engine.spec_batch import SpeculativeGenerationBatch

    timed: Any = SpeculativeGenerationBatch._timed  # called on a stand-in with its two fields
    batch = SimpleNamespace(costs=StepCosts(SpeculationSettings()), _timing=None)
    t = time.perf_counter()
    for _ in range(3):
        # Queued a verify step (1 x 9) at t + 0.01, found it done at t + 0.21.
        timed(batch, 1, 9, (t, t + 0.01))
        timed(batch, 1, 1, (t + 0.21, t + 0.22))
        batch._timing = None
    assert batch.costs.measured(1, 9) == pytest.approx(0.20)
    assert batch.costs.measured_gap(1) == pytest.approx(0.01)
    assert batch.costs.measured(1, 1) is None
    # Looked, then pipelined: nothing timed; pipelined, then looked: nothing timed.
    timed(batch, 1, 1, (t, t + 0.01))
    timed(batch, 1, 1, None)
    timed(batch, 1, 1, (t + 0.5, t + 0.51))
    assert batch.costs.measured(1, 1) is None
    # Pipelined after pipelined: the interval between the returns.
    batch._timing = None
    for _ in range(4):
        timed(batch, 1, 1, None)
    measured = batch.costs.measured(1, 1)
    assert measured is not None and 0 <= measured < 0.05


def test_a_slow_gap_makes_speculation_pay_less() -> None:
    """Where looking costs a fifth of a step, a verify of proposals accepted one time in five
    loses; where the gap is small, it wins."""
    settings = SpeculationSettings()
    for gap, speculates in ((0.033, False), (0.004, True)):
        costs = StepCosts(settings)
        for _ in range(3):
            costs.record(1, 1, 0.140)
            costs.record(1, 4, 0.143)
            costs.record_gap(1, gap)
        assert (plan([(3, 0.2)], 1, settings, costs) > 0) is speculates


def test_settings_are_checked() -> None:
    for bad in (
        {"max_draft": -1},
        {"max_draft": 65},
        {"max_rows": 0},
        {"min_ngram": 0},
        {"min_ngram": 3, "max_ngram": 2},
        {"verify_cost": (0.2,)},
        {"verify_cost": (0.2, -0.1)},
        {"sync_cost": -0.1},
    ):
        with pytest.raises(ValueError):
            SpeculationSettings(**bad)
    assert not OFF.active and not SpeculationSettings(max_draft=0).active
    assert SpeculationSettings().active


def test_the_extension_traits_set_the_workers_speculation() -> None:
    from traitlets import TraitError

    from jupyter_lmsp.engine.blas import BlasSelection
    from jupyter_lmsp.extension import LMSPExtension

    def worker_settings(**traits: Any) -> WorkerSettings:
        ext = LMSPExtension(**traits)
        ext.blas = BlasSelection(enabled=False)  # set by initialize_settings, unused here
        return ext._make_engine(lambda message: None)._settings

    default = worker_settings().speculation
    assert default.active and default.max_draft == SpeculationSettings().max_draft
    chosen = worker_settings(speculative_decoding=False, speculative_max_draft=3).speculation
    assert not chosen.active and chosen.max_draft == 3
    assert worker_settings(speculative_max_draft=64).speculation.max_draft == 64
    assert default.learn_costs
    assert not worker_settings(speculative_learn_costs=False).speculation.learn_costs
    for bad in (0, 65):
        with pytest.raises(TraitError, match="speculative_max_draft"):
            LMSPExtension(speculative_max_draft=bad)
    assert default.max_rows == DEFAULT_MAX_ROWS
    assert worker_settings(speculative_max_rows=8).speculation.max_rows == 8
    with pytest.raises(TraitError, match="speculative_max_rows"):
        LMSPExtension(speculative_max_rows=0)


# --- the ragged KV cache ----------------------------------------------------------------------


def test_ragged_cache_rows_give_their_single_sequence_logits(tiny) -> None:
    """Rows of different lengths, fed different numbers of tokens (padded), forgetting
    different numbers of positions: each row's logits are its own sequence's."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

    from jupyter_lmsp.engine.spec_batch import RaggedKVCache

    model, _ = tiny
    contexts = [list(range(3, 40)), list(range(50, 60)), list(range(100, 125))]
    feeds = [[7, 8, 9, 10], [11], [12, 13]]

    def single(context: list[int], fed: list[int]) -> tuple[mx.array, list[Any]]:
        cache = make_prompt_cache(model)
        model(mx.array([context]), cache=cache)
        return model(mx.array([fed]), cache=cache)[0], cache

    # Each context prefilled alone, merged as mlx-lm merges them (left-padded), then ragged.
    singles = []
    for context in contexts:
        cache = make_prompt_cache(model)
        model(mx.array([context]), cache=cache)
        singles.append(cache)
    ragged = [
        RaggedKVCache.from_batch(BatchKVCache.merge([s[layer] for s in singles]))
        for layer in range(len(model.layers))
    ]
    assert ragged[0].lengths == [len(c) for c in contexts]
    width = max(len(f) for f in feeds)
    fed = mx.array([f + [f[0]] * (width - len(f)) for f in feeds])
    logits = model(fed, cache=ragged)
    for i, (context, f) in enumerate(zip(contexts, feeds, strict=True)):
        want, _ = single(context, f)
        got = logits[i, : len(f)]
        assert mx.allclose(got, want, atol=1e-4).item(), i
        assert mx.array_equal(got.argmax(-1), want.argmax(-1)).item()

    # Keep 2, 1 and 1 of the positions just fed, feed one more token each: as if the rows had
    # been fed only what they kept.
    keep = [2, 1, 1]
    for layer in ragged:
        layer.rewind([len(c) + k for c, k in zip(contexts, keep, strict=True)])
    logits = model(mx.array([[20], [21], [22]]), cache=ragged)
    for i, (context, f, k) in enumerate(zip(contexts, feeds, keep, strict=True)):
        want, cache = single(context + f[:k], [20 + i])
        assert mx.allclose(logits[i, 0], want[0], atol=1e-4).item(), i
        # The row's cache, extracted, is the single sequence's.
        kept = ragged[0].extract(i)
        assert kept.offset == len(context) + k + 1
        assert mx.allclose(kept.keys, cache[0].keys[..., : kept.offset, :], atol=1e-5).item()
        assert ragged[0].extract(i, 3).offset == 3

    # Rows leave and join.
    for layer in ragged:
        layer.filter([2, 0])
    assert ragged[0].lengths == [len(contexts[2]) + 2, len(contexts[0]) + 3]
    extra = make_prompt_cache(model)
    model(mx.array([list(range(200, 205))]), cache=extra)
    for layer, part in zip(ragged, extra, strict=True):
        assert isinstance(part, KVCache)
        layer.extend(RaggedKVCache.from_batch(BatchKVCache.merge([part])))
    logits = model(mx.array([[30], [31], [32]]), cache=ragged)
    want, _ = single(list(range(200, 205)), [32])
    assert mx.allclose(logits[2, 0], want[0], atol=1e-4).item()
    with pytest.raises(ValueError):
        ragged[0].make_mask(1, window_size=4)


# --- the scheduler: speculation changes no token ----------------------------------------------


def jobs_of(questions: list[str], **kwargs: Any) -> list:
    return [job(f"q{i}", messages=chat(q), **kwargs) for i, q in enumerate(questions)]


def outputs(results: dict[tuple[str, int], Result]) -> dict:
    return {
        key: (r.tokens, r.text, r.finish_reason, [u.error for u in r.updates if u.error])
        for key, r in results.items()
    }


def drafted(results: dict[tuple[str, int], Result]) -> int:
    return sum(u.drafted for r in results.values() for u in r.updates)


@pytest.mark.parametrize("sampling", [{}, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("count", [1, 4], ids=["single", "batched"])
def test_speculation_changes_no_token(tiny, sampling: dict, count: int) -> None:
    model, tok = tiny
    questions = QUESTIONS[:count]
    off = run(
        model, tok, jobs_of(questions, max_tokens=80, **sampling), sched=scheduler(speculation=OFF)
    )
    for settings in (SpeculationSettings(), FORCED):
        sched = scheduler(speculation=settings)
        on = run(model, tok, jobs_of(questions, max_tokens=80, **sampling), sched=sched)
        assert outputs(on) == outputs(off), settings
        stats = sched.speculation_stats()
        assert drafted(on) == stats.accepted  # every kept proposal was output
        if settings is FORCED:
            # Proposals were verified, some kept, some not: the rollback path ran.
            assert stats.verify_steps > 0 and 0 < stats.accepted < stats.proposed
    assert drafted(off) == 0 and scheduler(speculation=OFF).speculation_stats().verify_steps == 0


def test_greedy_speculation_saves_steps_on_the_test_model(tiny) -> None:
    """The test model repeats itself: the adaptive settings speculate and need fewer steps.
    By the cost prior alone: learned from this machine's timing, whether the tiny model's
    sub-millisecond steps pay for a look depends on the CPU the suite runs on."""
    model, tok = tiny
    sched = scheduler(speculation=SpeculationSettings(learn_costs=False))
    results = run(model, tok, jobs_of(QUESTIONS[:1], max_tokens=120), sched=sched)
    tokens = len(results[("q0", 0)].tokens)
    stats = sched.speculation_stats()
    assert stats.accepted > 0 and stats.steps < tokens
    assert drafted(results) == stats.accepted
    # The same verifies counted by the n-gram length that proposed them.
    assert sum(p for p, _, _ in stats.by_ngram.values()) == stats.proposed
    assert sum(a for _, a, _ in stats.by_ngram.values()) == stats.accepted


def test_eight_rows_repeating_their_context_speculate_from_the_start(tiny) -> None:
    """Eight rows of the test model (which repeats itself) speculate by the prior alone; with
    one prior of 0.5 for every match length they never did."""
    model, tok = tiny
    counts = {}
    for name, prior in [("by length", DEFAULT_ACCEPTANCE_PRIOR), ("flat", (0.5,))]:
        speculation = SpeculationSettings(learn_costs=False, acceptance_prior=prior, max_rows=8)
        sched = scheduler(speculation=speculation, max_batch_size=8)
        jobs = [job(f"r{i}", messages=chat(QUESTIONS[i % 4]), max_tokens=80) for i in range(8)]
        results = run(model, tok, jobs, sched=sched)
        counts[name] = sched.speculation_stats().accepted
        assert drafted(results) == counts[name]
    assert counts["by length"] > 0 and counts["flat"] == 0, counts


def test_a_batch_larger_than_max_rows_neither_looks_nor_verifies(tiny) -> None:
    """Eight rows of the test model (which repeats itself, so eight rows allowed to verify
    do, above) by the default settings: all eight run to the end together, so no step ever
    has `max_rows` rows or fewer, and none looks or verifies. The text is the same. Four of
    them (`max_rows`) do speculate."""
    model, tok = tiny
    jobs = [job(f"r{i}", messages=chat(QUESTIONS[i % 4]), max_tokens=60) for i in range(8)]
    sched = scheduler(speculation=SpeculationSettings(learn_costs=False), max_batch_size=8)
    capped = run(model, tok, jobs, sched=sched)
    # Every row runs to max_tokens (greedy: the same on every run), so every step has eight.
    assert all(len(r.tokens) == 60 for r in capped.values())
    stats = sched.speculation_stats()
    assert stats.looked == stats.verify_steps == stats.accepted == drafted(capped) == 0
    off = run(model, tok, jobs, sched=scheduler(speculation=OFF, max_batch_size=8))
    assert outputs(capped) == outputs(off)
    # Four of them (the default max_rows) do speculate.
    sched = scheduler(speculation=SpeculationSettings(learn_costs=False), max_batch_size=8)
    run(model, tok, jobs[:DEFAULT_MAX_ROWS], sched=sched)
    assert sched.speculation_stats().accepted > 0


def test_step_costs_are_kept_from_batch_to_batch(tiny) -> None:
    """A model's batch is let go of whenever it has no job; what its steps cost is not."""
    model, tok = tiny
    sched = scheduler()
    run(model, tok, jobs_of(QUESTIONS[:1], max_tokens=40), sched=sched)
    costs = sched.step_costs("m")
    assert costs is not None and costs.measured(1, 1) is not None
    run(model, tok, jobs_of(QUESTIONS[1:2], max_tokens=40), sched=sched)
    assert sched.step_costs("m") is costs
    sched.forget_model("m")
    assert sched.step_costs("m") is None
    assert scheduler(speculation=OFF).step_costs("m") is None


class SlowPrefill:
    """The model, taking `delay` seconds more for every prefill chunk of `chunk` tokens."""

    def __init__(self, model: Any, chunk: int, delay: float) -> None:
        self.model, self.chunk, self.delay = model, chunk, delay

    def __call__(self, inputs: Any, cache: Any = None, **kwargs: Any) -> Any:
        import time

        if inputs.shape[1] == self.chunk:
            time.sleep(self.delay)
        return self.model(inputs, cache=cache, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


def test_steps_sharing_the_model_with_a_prefill_are_not_timed(tiny) -> None:
    """A prompt read while rows decode (and a row joining after a wait) makes that step's
    interval long: it must not count as what the step cost."""
    model, tok = tiny
    slow = SlowPrefill(model, chunk=16, delay=0.25)
    sched = scheduler(prefill_step=16)
    results: dict = {}
    add(sched, slow, tok, results, [job("runner", messages=chat(QUESTIONS[2]), max_tokens=60)])
    for step in range(200):
        if not sched.active:
            break
        collect(results, sched.step())
        if step == 10:
            long = [{"role": "user", "content": " ".join(QUESTIONS) * 2}]
            add(sched, slow, tok, results, [job("reader", messages=long, max_tokens=5)])
    assert results[("reader", 0)].finish_reason == "length"
    costs = sched.step_costs("m")
    assert costs is not None
    recorded = [t for samples in costs._compute.values() for t in samples]
    recorded += [t for samples in costs._gaps.values() for t in samples]
    assert recorded and max(recorded) < 0.25


@pytest.mark.parametrize("sampling", [{}, SEEDED], ids=["greedy", "seeded"])
def test_log_probabilities_are_the_same(tiny, sampling: dict) -> None:
    model, tok = tiny
    kwargs = {"max_tokens": 60, "logprobs": True, "top_logprobs": 3, **sampling}
    off = run(model, tok, jobs_of(QUESTIONS[:2], **kwargs), sched=scheduler(speculation=OFF))
    on = run(model, tok, jobs_of(QUESTIONS[:2], **kwargs), sched=scheduler(speculation=FORCED))
    assert drafted(on) > 0
    for key in off:
        a, b = on[key].logprobs, off[key].logprobs
        assert len(a) == len(b) == len(off[key].tokens)
        for x, y in zip(a, b, strict=True):
            assert (x.token_id, x.bytes) == (y.token_id, y.bytes)
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
            assert [t.token_id for t in x.top] == [t.token_id for t in y.top]
            for s, t in zip(x.top, y.top, strict=True):
                assert s.logprob == pytest.approx(t.logprob, abs=1e-4)


def test_stop_sequences_and_max_tokens_inside_a_verify_step(tiny) -> None:
    model, tok = tiny
    reference = run(
        model, tok, jobs_of(QUESTIONS[:1], max_tokens=80), sched=scheduler(speculation=OFF)
    )
    text = reference[("q0", 0)].text
    assert len(text) > 40
    cuts = [len(text) * k // 7 for k in range(1, 7)]
    for cut in cuts:
        stop = [text[cut : cut + 3]]
        kwargs = {"max_tokens": 80, "stop": stop}
        off = run(model, tok, jobs_of(QUESTIONS[:1], **kwargs), sched=scheduler(speculation=OFF))
        on = run(model, tok, jobs_of(QUESTIONS[:1], **kwargs), sched=scheduler(speculation=FORCED))
        assert outputs(on) == outputs(off), stop
        assert on[("q0", 0)].finish_reason == "stop"
    for max_tokens in (1, 2, 3, 5, 8, 13, 21, 34):
        off = run(
            model,
            tok,
            jobs_of(QUESTIONS[:2], max_tokens=max_tokens),
            sched=scheduler(speculation=OFF),
        )
        on = run(
            model,
            tok,
            jobs_of(QUESTIONS[:2], max_tokens=max_tokens),
            sched=scheduler(speculation=FORCED),
        )
        assert outputs(on) == outputs(off), max_tokens
        assert all(len(r.tokens) <= max_tokens for r in on.values())


def test_n_choices_are_the_same(tiny) -> None:
    model, tok = tiny
    kwargs = {"max_tokens": 50, "n": 3, **SEEDED}
    off = run(model, tok, jobs_of(QUESTIONS[:2], **kwargs), sched=scheduler(speculation=OFF))
    on = run(model, tok, jobs_of(QUESTIONS[:2], **kwargs), sched=scheduler(speculation=FORCED))
    assert len(off) == 6 and outputs(on) == outputs(off)
    greedy = {"max_tokens": 50, "n": 2}
    on = run(model, tok, jobs_of(QUESTIONS[2:3], **greedy), sched=scheduler(speculation=FORCED))
    assert drafted(on) > 0 and on[("q0", 0)].tokens == on[("q0", 1)].tokens


@pytest.mark.parametrize("sampling", [{}, SEEDED], ids=["greedy", "seeded"])
def test_grammar_rows_speculate_under_their_grammar_and_change_no_token(
    tiny, sampling: dict
) -> None:
    """Constrained rows propose (forced tokens, n-gram drafts cut to what the grammar allows)
    and verify each position under its own mask, beside unconstrained rows: the same tokens,
    text and log-probabilities as without speculation, and every output valid."""
    from schema_corpus import CORPUS
    from test_constrained import assert_valid, grammar_of

    model, tok = tiny
    names = ["person", "matrix", "array_of_objects", "enum_array"]
    grammars: dict[str, str | None] = {name: grammar_of(CORPUS[name]) for name in names}

    def jobs() -> list:
        kwargs = {"logprobs": True, "top_logprobs": 2, **sampling}
        return [job(name, max_tokens=300, **kwargs) for name in names] + (
            jobs_of(QUESTIONS[:2], max_tokens=80, **kwargs)
        )

    off = run(model, tok, jobs(), grammars, sched=scheduler(speculation=OFF))
    for settings in (SpeculationSettings(), FORCED):
        sched = scheduler(speculation=settings)
        on = run(model, tok, jobs(), grammars, sched=sched)
        assert outputs(on) == outputs(off), settings
        for name in names:
            assert_valid(CORPUS[name], on[(name, 0)].text, name)
        for key in off:
            a, b = on[key].logprobs, off[key].logprobs
            assert len(a) == len(b) == len(off[key].tokens), key
            for x, y in zip(a, b, strict=True):
                assert x.token_id == y.token_id
                assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
                assert [t.token_id for t in x.top] == [t.token_id for t in y.top]
        if settings is FORCED:
            constrained = sum(u.drafted for name in names for u in on[(name, 0)].updates)
            assert constrained > 0
            assert drafted(on) == sched.speculation_stats().accepted


@pytest.mark.parametrize("sampling", [{}, SEEDED], ids=["greedy", "seeded"])
def test_resumed_jobs_equal_the_uninterrupted_run_at_every_point(tiny, sampling: dict) -> None:
    from jupyter_lmsp.engine.messages import ChoiceResume

    model, tok = tiny
    full = run(
        model,
        tok,
        jobs_of(QUESTIONS[:1], max_tokens=60, **sampling),
        sched=scheduler(speculation=OFF),
    )[("q0", 0)]
    tokens = full.tokens
    resumed = []
    for k in range(1, len(tokens)):
        point = ChoiceResume(tokens[:k], streamed_text(tok, tokens[:k]))
        resumed.append(
            job(
                f"r{k}",
                messages=chat(QUESTIONS[0]),
                max_tokens=60,
                resume_choices=[point],
                **sampling,
            )
        )
    # Resumed side by side (8 rows at a time), speculating.
    for start in range(0, len(resumed), 8):
        group = resumed[start : start + 8]
        results = run(model, tok, group, sched=scheduler(speculation=FORCED))
        for j in group:
            k = len(j.resume_choices[0].token_ids)
            got = results[(j.job_id, 0)]
            assert tokens[:k] + got.tokens == tokens, k
            assert j.resume_choices[0].text + got.text == full.text, k


def test_rows_join_and_leave_while_a_verify_step_is_in_flight(
    tiny, caplog: pytest.LogCaptureFixture
) -> None:
    model, tok = tiny
    alone = {
        q: run(
            model,
            tok,
            [job("a", messages=chat(q), max_tokens=70)],
            sched=scheduler(speculation=OFF),
        )[("a", 0)]
        for q in QUESTIONS
    }
    sched = scheduler(speculation=FORCED, cache_bytes=1 << 30)
    results: dict = {}
    caplog.set_level(logging.WARNING)
    add(sched, model, tok, results, [job(QUESTIONS[0], messages=chat(QUESTIONS[0]), max_tokens=70)])
    add(sched, model, tok, results, [job("victim", messages=chat(QUESTIONS[3]), max_tokens=500)])
    for step in range(200):
        if not sched.active:
            break
        collect(results, sched.step())
        if step == 5:
            add(
                sched,
                model,
                tok,
                results,
                [job(QUESTIONS[1], messages=chat(QUESTIONS[1]), max_tokens=70)],
            )
        if step == 9:
            sched.cancel("victim")
        if step == 12:
            add(
                sched,
                model,
                tok,
                results,
                [job(QUESTIONS[2], messages=chat(QUESTIONS[2]), max_tokens=70)],
            )
    assert not sched.active
    for q in QUESTIONS[:3]:
        assert results[(q, 0)].tokens == alone[q].tokens, q
        assert results[(q, 0)].text == alone[q].text, q
    assert sched.speculation_stats().verify_steps > 0
    # Every cache kept (prefilled prompts, ended and cancelled rows) held exactly its tokens.
    assert not [r for r in caplog.records if "not caching" in r.getMessage()]
    # And a prompt cached from a speculating row is reused correctly.
    again = run(model, tok, [job("again", messages=chat(QUESTIONS[0]), max_tokens=70)], sched=sched)
    assert again[("again", 0)].tokens == alone[QUESTIONS[0]].tokens


# --- through the worker process ---------------------------------------------------------------


def test_the_worker_reports_accepted_draft_tokens(test_model_dir: Path) -> None:
    from test_engine import new_id, start_engine

    from jupyter_lmsp.engine.messages import ChoiceFinished, JobFinished

    engines = {
        name: start_engine(test_model_dir, settings=WorkerSettings(speculation=settings))
        for name, settings in (("off", OFF), ("on", SpeculationSettings()), ("forced", FORCED))
    }
    try:
        runs = {
            name: eng.run(new_id(name), messages=chat(QUESTIONS[2]), max_tokens=80)
            for name, eng in engines.items()
        }
        for name, r in runs.items():
            assert isinstance(r.end, JobFinished), (name, r.end)
            assert (r.tokens, r.text) == (runs["off"].tokens, runs["off"].text), name
            assert r.end.accepted_draft_tokens == r.end.choices[0].accepted_draft_tokens
        assert runs["off"].end.accepted_draft_tokens == 0
        forced = runs["forced"].end.accepted_draft_tokens
        assert 0 < forced < len(runs["forced"].tokens)
        # n choices: per choice, and the sum.
        eng = engines["forced"]
        n = eng.run(new_id("n"), messages=chat(QUESTIONS[2]), max_tokens=60, n=2)
        assert isinstance(n.end, JobFinished)
        finished = [m for m in eng.recorder.for_job(n.end.job_id) if isinstance(m, ChoiceFinished)]
        counts = [c.accepted_draft_tokens for c in n.end.choices]
        assert sorted(counts) == sorted(m.accepted_draft_tokens for m in finished)
        assert n.end.accepted_draft_tokens == sum(counts) > 0
    finally:
        for eng in engines.values():
            eng.client.stop()


# The demo model, two engines, ten runs: ~40 s alone on a quiet machine; a loaded one (make test
# beside a CPU hog, load ~10) has taken over 5 minutes.
# Tokens a run generates: the summary alone has accepted drafted tokens (16 of its 24 here) and
# named the lighthouse well before; 40 took a third longer for the same checks.
GROUNDED_TOKENS = 24


@pytest.mark.timeout(900)
def test_the_demo_model_gives_the_same_text_on_a_grounded_task(
    demo_model_dir: Path, worker_blas: Any
) -> None:
    """The real model on the BLAS the service uses: summaries and a story, greedy and seeded,
    alone and side by side, with the worker's own (adaptive) speculation and without."""
    from test_engine import new_id, start_engine
    from texts import PROOFREAD, STORY, SUMMARISE

    from jupyter_lmsp.engine.messages import JobFinished

    engines = {
        name: start_engine(
            demo_model_dir, env=worker_blas.env, settings=WorkerSettings(speculation=settings)
        )
        for name, settings in (("off", OFF), ("on", SpeculationSettings()))
    }
    tasks = [
        (SUMMARISE, {}),
        (SUMMARISE, {"temperature": 0.7, "top_p": 0.9, "seed": 3}),
        (PROOFREAD, {}),
        (STORY, {"temperature": 0.8, "seed": 11}),
    ]
    try:
        texts: dict[str, list] = {}
        for name, eng in engines.items():
            alone = [
                eng.run(
                    new_id(),
                    messages=[{"role": "user", "content": p}],
                    max_tokens=GROUNDED_TOKENS,
                    **s,
                )
                for p, s in tasks[:1]
            ]
            batch = [
                eng.job(
                    new_id(),
                    messages=[{"role": "user", "content": p}],
                    max_tokens=GROUNDED_TOKENS,
                    **s,
                )
                for p, s in tasks
            ]
            for j in batch:
                eng.client.submit(j)
            together = [eng.wait_end(j.job_id, timeout=300) for j in batch]
            runs = alone + together
            assert all(isinstance(r.end, JobFinished) for r in runs), [r.end for r in runs]
            texts[name] = [(r.tokens, r.text) for r in runs]
            if name == "on":
                # The summary alone repeats its source: the worker speculated, and it paid.
                assert runs[0].end.accepted_draft_tokens > 0
        assert texts["on"] == texts["off"]
        assert "lighthouse" in texts["off"][0][1].lower()
    finally:
        for eng in engines.values():
            eng.client.stop()


def test_the_token_delay_hook_stays_per_token_while_speculating(test_model_dir: Path) -> None:
    """`token_delay` (crash tests, demos) paces every token, however many a step brings."""
    import time

    from test_engine import new_id, start_engine

    from jupyter_lmsp.engine.messages import JobFinished, JobStarted

    eng = start_engine(
        test_model_dir, token_delay=0.02, settings=WorkerSettings(speculation=FORCED)
    )
    try:
        job_id = new_id("paced")
        eng.client.submit(eng.job(job_id, messages=chat(QUESTIONS[2]), max_tokens=60))
        eng.recorder.wait_for(lambda m: isinstance(m, JobStarted) and m.job_id == job_id)
        started = time.monotonic()
        run = eng.wait_end(job_id)
        elapsed = time.monotonic() - started
        assert isinstance(run.end, JobFinished) and len(run.tokens) == 60
        assert run.end.accepted_draft_tokens > 10  # steps brought several tokens
        assert elapsed >= 60 * 0.02 * 0.9
    finally:
        eng.client.stop()
