"""Several choices per job (n > 1): rows of one batch, one prefill, reproducible with a seed.

In this process (the scheduler, the test model wrapped to record its calls) and through the
worker (`ChoiceFinished`, `JobFinished.choices`, per-choice `JobTokens`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from schedrun import CHAT, add, collect, job, run, scheduler
from test_engine import END_TYPES, new_id, start_engine

from jupyter_lmsp.engine.messages import (
    ChoiceFinished,
    ChoiceResume,
    JobCancelled,
    JobFinished,
    JobTokens,
    WorkerSettings,
)
from jupyter_lmsp.engine.sampling import choice_seed
from jupyter_lmsp.engine.speculative import OFF
from jupyter_lmsp.engine.worker import encode_chat

pytestmark = pytest.mark.timeout(120)

SEEDED = {"temperature": 1.0, "top_p": 0.9, "seed": 1234}


class Recording:
    """The model, recording the shape of every forward call."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.calls: list[tuple[int, ...]] = []

    def __call__(self, inputs: Any, cache: Any = None, **kwargs: Any) -> Any:
        self.calls.append(tuple(inputs.shape))
        return self.model(inputs, cache=cache, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


def texts(results: dict, job_id: str, n: int) -> list[str]:
    return [results[(job_id, i)].text for i in range(n)]


def test_seeded_choices_are_reproducible_and_each_is_its_own_run(tiny) -> None:
    model, tok = tiny
    first = run(model, tok, [job("a", n=3, max_tokens=30, **SEEDED)])
    again = run(model, tok, [job("b", n=3, max_tokens=30, **SEEDED)])
    assert texts(first, "a", 3) == texts(again, "b", 3)
    assert len(set(texts(first, "a", 3))) == 3
    # Choice i is exactly a single run seeded choice_seed(seed, i) (choice 0: the seed itself).
    for i in range(3):
        single = {**SEEDED, "seed": choice_seed(SEEDED["seed"], i)}
        alone = run(model, tok, [job(f"alone{i}", max_tokens=30, **single)])[(f"alone{i}", 0)]
        assert first[("a", i)].tokens == alone.tokens and first[("a", i)].text == alone.text
    assert choice_seed(5, 0) == 5 and choice_seed(5, 1) != choice_seed(6, 1)
    # Greedy choices are all the same answer.
    greedy = run(model, tok, [job("g", n=2, max_tokens=20)])
    assert greedy[("g", 0)].tokens == greedy[("g", 1)].tokens


@pytest.mark.parametrize("cached", [False, True], ids=["cold", "prompt-cached"])
def test_the_prompt_is_prefilled_once(tiny, cached: bool) -> None:
    model, tok = tiny
    recording = Recording(model)
    prompt = encode_chat(tok, CHAT)
    # Counts the model's calls by shape: no verify steps (speculation) among them.
    sched = scheduler(prefill_step=16, cache_bytes=1 << 30 if cached else 0, speculation=OFF)
    if cached:
        run(recording, tok, [job("primer", max_tokens=2)], sched=sched)
    recording.calls.clear()
    results = run(recording, tok, [job("n", n=3, max_tokens=10, **SEEDED)], sched=sched)
    prefill = [shape for shape in recording.calls if shape[1] > 1]
    if cached:
        assert prefill == []  # everything but the last prompt token came from the cache
    else:
        # One row reads the prompt (all but its last token), in chunks of 16.
        assert all(batch == 1 for batch, _ in prefill)
        assert sum(length for _, length in prefill) == len(prompt) - 1
        assert max(length for _, length in prefill) == 16
    # Then the three rows decode together.
    assert (3, 1) in recording.calls
    assert len(recording.calls) < 3 * 12
    alone = run(model, tok, [job("n1", n=3, max_tokens=10, **SEEDED)])
    assert texts(results, "n", 3) == texts(alone, "n1", 3)


def test_resumed_choices_reproduce_the_uninterrupted_run(tiny) -> None:
    from schedrun import streamed_text

    model, tok = tiny
    full = run(model, tok, [job("full", n=3, max_tokens=40, stop=["\x00"], **SEEDED)])
    tokens = [full[("full", i)].tokens for i in range(3)]
    points = [
        ChoiceResume(tokens[0][:7], streamed_text(tok, tokens[0][:7])),
        ChoiceResume(tokens[1], full[("full", 1)].text, full[("full", 1)].finish_reason),
        ChoiceResume(tokens[2][:21], streamed_text(tok, tokens[2][:21])),
    ]
    resumed = run(
        model,
        tok,
        [job("resumed", n=3, max_tokens=40, stop=["\x00"], resume_choices=points, **SEEDED)],
    )
    for i, point in enumerate(points):
        assert point.token_ids + resumed[("resumed", i)].tokens == tokens[i], i
        assert point.text + resumed[("resumed", i)].text == full[("full", i)].text, i
        assert resumed[("resumed", i)].finish_reason == full[("full", i)].finish_reason
    assert resumed[("resumed", 1)].tokens == []  # it had ended: not generated again


def test_cancelling_a_job_removes_all_its_rows(tiny) -> None:
    model, tok = tiny
    sched = scheduler()
    results: dict = {}
    add(sched, model, tok, results, [job("many", n=3, max_tokens=500), job("other", max_tokens=30)])
    for _ in range(5):
        collect(results, sched.step())
    assert sched.load == 4
    generated = sched.cancel("many")
    assert generated == sum(len(results[("many", i)].tokens) for i in range(3)) > 0
    assert sched.load == 1 and sched.cancel("many") is None
    while sched.active:
        collect(results, sched.step())
    alone = run(model, tok, [job("other-alone", max_tokens=30)])
    assert results[("other", 0)].tokens == alone[("other-alone", 0)].tokens


def test_choices_through_the_worker(test_model_dir: Path) -> None:
    eng = start_engine(test_model_dir, settings=WorkerSettings(max_batch_size=4))
    try:
        job_id = new_id("n3")
        eng.client.submit(eng.job(job_id, n=3, max_tokens=24, stop=["\x00"], **SEEDED))
        end = eng.recorder.wait_for(lambda m: isinstance(m, END_TYPES) and m.job_id == job_id)
        messages = eng.recorder.for_job(job_id)
        assert isinstance(end, JobFinished)
        chunks = [m for m in messages if isinstance(m, JobTokens)]
        finished = [m for m in messages if isinstance(m, ChoiceFinished)]
        assert sorted(m.choice for m in finished) == [0, 1, 2]
        assert [c.choice for c in end.choices] == [0, 1, 2]
        assert end.output_tokens == sum(c.output_tokens for c in end.choices)
        assert end.finish_reason == end.choices[0].finish_reason
        for choice in range(3):
            mine = [c for c in chunks if c.choice == choice]
            tokens = [t for c in mine for t in c.token_ids]
            assert len(tokens) == end.choices[choice].output_tokens
            # Each choice's messages come before its ChoiceFinished.
            done_at = messages.index(next(m for m in finished if m.choice == choice))
            assert all(messages.index(c) < done_at for c in mine)
        again = eng.run(new_id("again"), n=3, max_tokens=24, stop=["\x00"], **SEEDED)
        assert [c.output_tokens for c in again.end.choices] == [  # type: ignore[attr-defined]
            c.output_tokens for c in end.choices
        ]

        # A job with more choices than rows runs alone; its cancel frees them all.
        big = new_id("big")
        eng.client.submit(eng.job(big, n=6, max_tokens=500))
        eng.recorder.wait_for(lambda m: isinstance(m, JobTokens) and m.job_id == big)
        eng.client.cancel(big)
        eng.client.cancel(big)  # repeated: harmless
        cancelled = eng.wait_end(big)
        assert isinstance(cancelled.end, JobCancelled)
        assert cancelled.end.output_tokens == len(cancelled.tokens)
        assert eng.run(new_id("after"), max_tokens=4).end.finish_reason == "length"  # type: ignore[attr-defined]
        assert len([m for m in eng.recorder.for_job(big) if isinstance(m, END_TYPES)]) == 1
    finally:
        eng.client.stop()
