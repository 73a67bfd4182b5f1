"""Fair prefill (issue 43): a long prompt is read in cost-sized chunks between other rows' steps.

In this process, the scheduler and the tiny test model wrapped to record the shape of every
forward call: the order of operations, not their timing (the time bound is measured by
benchmarks/bench_prefill_fairness.py). While a row decodes, every chunk of a long prompt
follows one decode step of that row, and the chunks shrink as the context read grows, as
`prefill.chunk_tokens` sizes them; read alone, a prompt takes full chunks. The tokens are the
ones the prompt gives read alone.

The pacer (`prefill.ChunkPacer`) corrects the chunk sizes by what the chunks cost: checked on
given costs (a cost curve the model gets wrong, one it gets right) and in the scheduler with
a clock that counts the positions the model reads. A step that reads prompt tokens beside a
decoding row verifies no drafts, however speculation is set; with no row decoding beside it, a
prompt's first decode step verifies what the prompt proposes.
"""

from __future__ import annotations

from typing import Any

import pytest
from schedrun import FORCED, Result, add, collect, job, scheduler
from test_choices import Recording

from jupyter_lmsp.engine.prefill import (
    MIN_CHUNK,
    ChunkPacer,
    chunk_cost,
    chunk_tokens,
    designed_cost,
)
from jupyter_lmsp.engine.speculative import OFF, SpeculationSettings
from jupyter_lmsp.engine.worker import encode_chat

pytestmark = pytest.mark.timeout(120)

STEP = 32
# A small K for the tiny model's short prompts, so the chunks shrink within a few hundred
# tokens (the default is the demo model's, measured).
BREAK_EVEN = 32
WORDS = "The library opens at nine and closes at six, except on Sundays. " * 30
LONG = [{"role": "user", "content": WORDS}]


def planned(context_tokens: int, decoding: bool) -> list[int]:
    """The chunks `chunk_tokens` gives a prompt of `context_tokens` tokens (its last token is
    not prefilled: it starts decoding)."""
    chunks, read = [], 0
    while read < context_tokens - 1:
        size = chunk_tokens(read, STEP, BREAK_EVEN) if decoding else STEP
        size = min(size, context_tokens - 1 - read)
        chunks.append(size)
        read += size
    return chunks


class Counting(Recording):
    """The model, recording call shapes and counting every position it reads: a clock."""

    def __init__(self, model: Any) -> None:
        super().__init__(model)
        self.positions = 0

    def __call__(self, inputs: Any, cache: Any = None, **kwargs: Any) -> Any:
        self.positions += inputs.shape[0] * inputs.shape[1]
        return super().__call__(inputs, cache=cache, **kwargs)


def read_long(
    model: Any,
    tok: Any,
    beside_runner: bool,
    speculation: SpeculationSettings = OFF,
    pacer_clock: bool = False,
) -> tuple[list[tuple[int, ...]], Result]:
    """Read LONG (8 tokens out), beside a decoding row or alone; the model calls from LONG's
    admission to its first token, and LONG's result. With `pacer_clock`, chunks are paced by
    a clock that counts the positions the model reads (else the cost model alone)."""
    recording = Counting(model)
    sched = scheduler(
        prefill_step=STEP,
        speculation=speculation,
        prefill_break_even=BREAK_EVEN,
        prefill_pacing=pacer_clock,
    )
    if pacer_clock:
        sched._pacers["m"] = ChunkPacer(STEP, BREAK_EVEN, clock=lambda: recording.positions)
    results: dict = {}
    if beside_runner:
        add(sched, recording, tok, results, [job("runner", max_tokens=2000)])
        while not results[("runner", 0)].tokens:
            collect(results, sched.step())
    add(sched, recording, tok, results, [job("long", messages=LONG, max_tokens=8)])
    recording.calls.clear()
    calls: list[tuple[int, ...]] = []
    while not results[("long", 0)].tokens:
        collect(results, sched.step())
        calls += recording.calls
        recording.calls.clear()
    while "long" in sched:
        collect(results, sched.step())
    sched.cancel("runner")
    assert not sched.active
    return calls, results[("long", 0)]


def test_a_long_prompt_beside_a_decoding_row_is_read_in_cost_sized_chunks(tiny) -> None:
    model, tok = tiny
    prompt = encode_chat(tok, LONG)
    assert len(prompt) > 400
    calls, long = read_long(model, tok, beside_runner=True)
    chunks = planned(len(prompt), decoding=True)
    # Each step: the runner's decode step, then one chunk of the long prompt; then the step
    # that moves it into the batch (the runner's step, the long prompt's first pass), and the
    # first step of both rows together, which hands out that pass's token.
    expected = [call for size in chunks for call in [(1, 1), (1, size)]]
    assert calls == [*expected, (1, 1), (1, 1), (2, 1)]
    # The cost model: the first chunk is a full step, and they shrink as the context grows,
    # each costing no more than the designed chunk (a full step from position 0) until the
    # floor.
    assert chunks[0] == STEP and chunks[-2] < STEP
    assert chunks[:-1] == sorted(chunks[:-1], reverse=True)
    read = 0
    for size in chunks[:-1]:
        if size > MIN_CHUNK:
            assert chunk_cost(size, read, BREAK_EVEN) <= designed_cost(STEP, BREAK_EVEN)
        read += size
    # Read in small chunks or whole, the prompt gives the same tokens.
    _, alone = read_long(model, tok, beside_runner=False)
    assert long.tokens == alone.tokens and len(long.tokens) > 0


def test_a_prompt_read_with_no_row_decoding_takes_full_chunks(tiny) -> None:
    model, tok = tiny
    prompt = encode_chat(tok, LONG)
    calls, _ = read_long(model, tok, beside_runner=False)
    chunks = planned(len(prompt), decoding=False)
    # The first pass of the prompt's last token, then the step that hands out its token.
    assert calls == [(1, size) for size in chunks] + [(1, 1), (1, 1)]
    assert chunks[0] == chunks[-2] == STEP


def test_chunk_tokens_keeps_the_designed_cost() -> None:
    """At no context a chunk is a full step; further in, the largest chunk within the designed
    cost (one more token would exceed it), down to the floor."""
    for step, k in [(128, 850), (32, 32), (16, 1000)]:
        assert chunk_tokens(0, step, k) == step
        budget = designed_cost(step, k)
        for context in [1, 50, 500, 5000, 50000]:
            n = chunk_tokens(context, step, k)
            assert MIN_CHUNK <= n <= step
            if n > MIN_CHUNK:
                assert chunk_cost(n, context, k) <= budget < chunk_cost(n + 1, context, k)
        assert chunk_tokens(10**6, step, k) == MIN_CHUNK
    assert chunk_tokens(500, 4, 850) == 4  # a step under the floor is kept as it is


@pytest.mark.parametrize("speculation", [OFF, FORCED], ids=["off", "forced"])
def test_a_step_that_reads_a_prompt_verifies_no_drafts(tiny, speculation) -> None:
    """Speculation forced on (a verify step whenever the repeating test model's row has a
    proposal): while a long prompt is read, and in the step that moves it into decoding, the
    decoding row takes ordinary steps, the very calls it takes with speculation off; then it
    verifies again."""
    model, tok = tiny
    calls, _ = read_long(model, tok, beside_runner=True, speculation=speculation)
    chunks = planned(len(encode_chat(tok, LONG)), decoding=True)
    assert calls == [*[c for size in chunks for c in [(1, 1), (1, size)]], (1, 1), (1, 1), (2, 1)]
    if speculation is FORCED:
        recording = Recording(model)
        sched = scheduler(prefill_step=STEP, speculation=FORCED, prefill_pacing=False)
        results: dict = {}
        add(sched, recording, tok, results, [job("runner", max_tokens=200)])
        while "runner" in sched:
            collect(results, sched.step())
        assert any(positions > 1 for _, positions in recording.calls[1:]), recording.calls


def test_the_pacer_holds_each_step_at_the_target_where_the_model_is_wrong() -> None:
    """A device whose attention is dearer than the model says (the true K 600, the model's
    850) and a decode step beside every chunk: the model alone lets the steps grow to over
    1.2 times the first one's cost; paced, the first chunk sets the target and from the
    sixth on every step costs within 10% of it."""
    k, step, decode, true_k = 850, 128, 0.02, 600

    def seconds(n: int, context: int) -> float:
        return decode + 0.004 * chunk_cost(n, context, true_k) / true_k

    def read(pacer: ChunkPacer | None) -> list[float]:
        costs, context = [], 0
        while context < 6000:
            n = pacer.tokens(context) if pacer else chunk_tokens(context, step, k)
            costs.append(seconds(n, context))
            if pacer:
                pacer.measured(n, context, costs[-1])
            context += n
        return costs

    alone = read(None)
    assert max(alone) > 1.2 * alone[0]
    pacer = ChunkPacer(step, k)
    paced = read(pacer)
    target = pacer.target
    assert target is not None and abs(target - paced[0]) < 0.05 * paced[0]
    settled = paced[6:]
    assert all(abs(cost - target) < 0.1 * target for cost in settled), settled
    assert pacer.budget < 1.0


def test_the_pacer_leaves_a_right_model_alone() -> None:
    """Where the chunks cost what the model says, the budget stays at one (within 2%: the
    decode step's share does not scale with a chunk rounded down to whole tokens): the
    chunks are the model's, within a token."""
    k, step = 850, 128
    pacer = ChunkPacer(step, k)
    context = 0
    while context < 6000:
        n = pacer.tokens(context)
        assert abs(n - chunk_tokens(context, step, k)) <= 1
        pacer.measured(n, context, 0.01 + 0.004 * chunk_cost(n, context, k) / k)
        context += n
    assert abs(pacer.budget - 1.0) < 0.02


def test_the_scheduler_paces_chunks_by_what_they_cost(tiny) -> None:
    """In the scheduler, a clock that counts the positions the model reads (so a chunk
    costs its tokens, whatever the context: far cheaper than the model's small K says):
    the pacer learns it and the chunks stay larger than the model alone would make them,
    the prompt read in fewer steps; the tokens are the same."""
    model, tok = tiny
    size = len(encode_chat(tok, LONG))
    calls, paced = read_long(model, tok, beside_runner=True, pacer_clock=True)
    chunks = [positions for _, positions in calls if positions > 1]
    model_alone = planned(size, decoding=True)
    assert sum(chunks) == sum(model_alone[:-1]) + (model_alone[-1] if model_alone[-1] > 1 else 0)
    assert len(chunks) < len(model_alone) - 2, (chunks, model_alone)
    assert max(chunks[4:]) > max(model_alone[4:-1]), (chunks, model_alone)
    _, alone = read_long(model, tok, beside_runner=False)
    assert paced.tokens == alone.tokens


def test_a_prompt_read_with_no_row_decoding_verifies_drafts_from_its_first_step(
    tmp_path,
) -> None:
    """With no row decoding beside it, a new row's first decode step may verify drafts: nobody
    waits for it. The scripted model's greedy output is its script, which the prompt holds:
    the first token generated is found in the prompt, its continuation is proposed and
    verified in that step, and the tokens are the script, as without speculation."""
    from mlx_lm import load
    from scriptedmodel import make_scripted_model

    script = ("<s1>", "<s2>", "<s3>", "<s4>", "<s5>")
    model, tok = load(str(make_scripted_model(tmp_path / "scripted", script=script)))[:2]
    messages = [{"role": "user", "content": "say " + "".join(script) + " please"}]
    expected = [tok.convert_tokens_to_ids(t) for t in script]
    got = {}
    for speculation in (OFF, FORCED):
        recording = Recording(model)
        sched = scheduler(prefill_step=STEP, speculation=speculation, prefill_pacing=False)
        results: dict = {}
        add(sched, recording, tok, results, [job("j", messages=messages, max_tokens=16)])
        while "j" in sched:
            collect(results, sched.step())
        assert results[("j", 0)].tokens == expected
        got[speculation is FORCED] = recording.calls
    prompt = len(encode_chat(tok, messages))
    # Prefill, the prompt's last token (giving <s1>), then one step per token.
    assert got[False][:3] == [(1, prompt - 1), (1, 1), (1, 1)]
    # ... or <s1> fed with what follows it in the prompt (<s2> to <s5> at least), verified.
    assert got[True][:2] == got[False][:2]
    assert got[True][2][0] == 1 and got[True][2][1] >= 5, got[True]
