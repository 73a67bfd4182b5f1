"""Fair prefill (issue 43): a long prompt is read in cost-sized chunks between other rows' steps.

In this process, the scheduler and the tiny test model wrapped to record the shape of every
forward call: the order of operations, not their timing (the time bound is measured by
benchmarks/bench_prefill_fairness.py). While a row decodes, every chunk of a long prompt
follows one decode step of that row, and the chunks shrink as the context read grows, as
`prefill.chunk_tokens` sizes them; read alone, a prompt takes full chunks. The tokens are the
ones the prompt gives read alone.
"""

from __future__ import annotations

from typing import Any

import pytest
from schedrun import Result, add, collect, job, scheduler
from test_choices import Recording

from jupyter_lmsp.engine.prefill import MIN_CHUNK, chunk_cost, chunk_tokens, designed_cost
from jupyter_lmsp.engine.speculative import OFF
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


def read_long(model: Any, tok: Any, beside_runner: bool) -> tuple[list[tuple[int, ...]], Result]:
    """Read LONG (8 tokens out), beside a decoding row or alone; the model calls from LONG's
    admission to its first token, and LONG's result."""
    recording = Recording(model)
    sched = scheduler(prefill_step=STEP, speculation=OFF, prefill_break_even=BREAK_EVEN)
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
