"""Continuous batching and the prompt cache, with the tiny test model.

In the worker process (through `EngineClient`): concurrent jobs give the same tokens and text as
the same jobs run one after another (greedy, seeded, mixed, joining mid-run, a neighbour
cancelled), cancel latency in tokens inside a batch, the batch-size limit, prompt-cache reuse
for a follow-up turn (same tokens as a cold run, cached tokens reported), and resumed jobs
decoding side by side. In this process: `BatchScheduler` against bare `mlx_lm.generate_step`,
and `PromptCache`'s prefix matching, eviction and aliasing rules.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_engine import (
    CHAT,
    END_TYPES,
    SEEDED,
    Engine,
    Run,
    detokenized,
    new_id,
    start_engine,
)

from jupyter_lmsp.engine.blas import BlasChoice
from jupyter_lmsp.engine.messages import (
    GenerateJob,
    JobCancelled,
    JobFailed,
    JobFinished,
    JobStarted,
    JobTokens,
    WorkerSettings,
)

pytestmark = pytest.mark.timeout(90)

QUESTIONS = [
    "Tell me about the café on the corner.",
    "What is the weather like today in the mountains?",
    "Summarise: the server streams events to every client that is watching.",
    "Why?",
    "Python is a programming language that lets you work quickly. Is it?",
    "A task can be cancelled, resumed after a crash, or left to finish. Explain.",
]


def chat(question: str) -> list[dict[str, str]]:
    return [CHAT[0], {"role": "user", "content": question}]


@pytest.fixture(scope="module")
def engine(test_model_dir: Path) -> Iterator[Engine]:
    eng = start_engine(test_model_dir)
    yield eng
    eng.client.stop()


@pytest.fixture(scope="module")
def cold_engine(test_model_dir: Path) -> Iterator[Engine]:
    """A worker without a prompt cache: every prompt is prefilled from scratch."""
    eng = start_engine(test_model_dir, settings=WorkerSettings(prompt_cache_bytes=0))
    yield eng
    eng.client.stop()


@pytest.fixture(scope="module")
def slow_engine(test_model_dir: Path) -> Iterator[Engine]:
    """50 ms after each step, at most three jobs at once, every step's tokens sent."""
    eng = start_engine(
        test_model_dir, token_delay=0.05, settings=WorkerSettings(max_batch_size=3, send_interval=0)
    )
    yield eng
    eng.client.stop()


def run_concurrently(eng: Engine, jobs: list[GenerateJob]) -> list[Run]:
    for job in jobs:
        eng.client.submit(job)
    return [eng.wait_end(job.job_id) for job in jobs]


def run_sequentially(eng: Engine, jobs: list[GenerateJob]) -> list[Run]:
    runs = []
    for job in jobs:
        eng.client.submit(job)
        runs.append(eng.wait_end(job.job_id))
    return runs


def overlapped(eng: Engine, job_ids: list[str]) -> bool:
    """Whether every job produced a token before any of them ended: they shared the batch."""
    messages = [m for m in eng.recorder.messages if getattr(m, "job_id", None) in job_ids]
    first_end = next(i for i, m in enumerate(messages) if isinstance(m, END_TYPES))
    before = {m.job_id for m in messages[:first_end] if isinstance(m, JobTokens)}
    return before == set(job_ids)


def assert_same(batched: list[Run], sequential: list[Run]) -> None:
    for i, (b, s) in enumerate(zip(batched, sequential, strict=True)):
        assert isinstance(b.end, JobFinished) and isinstance(s.end, JobFinished), (i, b.end)
        assert b.tokens == s.tokens, f"job {i}: batched tokens differ from sequential"
        assert b.text == s.text, i
        assert b.end.finish_reason == s.end.finish_reason
        assert b.end.output_tokens == s.end.output_tokens == len(b.tokens)


# --- batched = sequential -------------------------------------------------------------------


def test_concurrent_greedy_jobs_match_sequential_runs(engine: Engine, tokenizer) -> None:
    def jobs() -> list[GenerateJob]:
        return [
            engine.job(new_id("greedy"), messages=chat(q), max_tokens=48 + 8 * i)
            for i, q in enumerate(QUESTIONS[:4])
        ]

    sequential = run_sequentially(engine, jobs())
    batch = jobs()
    batched = run_concurrently(engine, batch)
    assert overlapped(engine, [job.job_id for job in batch])
    assert_same(batched, sequential)
    # Different prompts, different outputs: the rows of the batch did not get mixed up.
    assert len({tuple(run.tokens) for run in batched}) == 4
    for run in batched:
        assert run.text == detokenized(tokenizer, run.tokens, final=True)


def test_concurrent_seeded_and_greedy_jobs_match_sequential_runs(engine: Engine) -> None:
    settings = [
        SEEDED,
        {**SEEDED, "seed": 7},
        {},
        {"temperature": 0.7, "top_p": 1.0, "seed": 1234},
        {**SEEDED, "seed": 7},  # same seed, other prompt
    ]

    def jobs() -> list[GenerateJob]:
        return [
            engine.job(new_id("mixed"), messages=chat(QUESTIONS[i]), max_tokens=40, **s)
            for i, s in enumerate(settings)
        ]

    sequential = run_sequentially(engine, jobs())
    batched = run_concurrently(engine, jobs())
    assert_same(batched, sequential)


def test_jobs_joining_and_leaving_mid_run_do_not_disturb_others(
    slow_engine: Engine,
) -> None:
    eng = slow_engine

    def job(i: int, max_tokens: int = 30) -> GenerateJob:
        return eng.job(new_id("join"), messages=chat(QUESTIONS[i]), max_tokens=max_tokens)

    reference = run_sequentially(eng, [job(0), job(1), job(2)])

    first, victim = job(0), job(5, max_tokens=500)
    eng.client.submit(first)
    eng.client.submit(victim)
    # Join after the first has some tokens, then drop the victim while both others run.
    eng.recorder.wait_for(lambda m: isinstance(m, JobTokens) and m.job_id == first.job_id)
    second = job(1)
    eng.client.submit(second)
    eng.recorder.wait_for(lambda m: isinstance(m, JobTokens) and m.job_id == second.job_id)
    eng.client.cancel(victim.job_id)
    assert isinstance(eng.wait_end(victim.job_id).end, JobCancelled)
    third = job(2)  # takes the freed slot
    eng.client.submit(third)
    runs = [eng.wait_end(j.job_id) for j in (first, second, third)]
    assert overlapped(eng, [first.job_id, second.job_id, victim.job_id])
    assert_same(runs, reference)


# --- cancel and limits ------------------------------------------------------------------------


def test_cancel_inside_a_batch_acts_within_one_step(slow_engine: Engine) -> None:
    eng = slow_engine
    ids = [new_id("c") for _ in range(3)]
    for i, job_id in enumerate(ids):
        eng.client.submit(eng.job(job_id, messages=chat(QUESTIONS[i]), max_tokens=500))

    def tokens_of(job_id: str, since: int = 0) -> int:
        return sum(
            len(m.token_ids)
            for m in eng.recorder.messages[since:]
            if isinstance(m, JobTokens) and m.job_id == job_id
        )

    eng.recorder.wait_for(lambda m: all(tokens_of(j) >= 3 for j in ids))
    mark = eng.recorder.mark()
    eng.client.cancel(ids[1])
    cancelled = eng.wait_end(ids[1], timeout=5)
    assert isinstance(cancelled.end, JobCancelled)
    # Latency in tokens: at most the step in flight when the cancel arrived.
    assert tokens_of(ids[1], since=mark) <= 1
    assert cancelled.end.output_tokens == len(cancelled.tokens)
    # The others keep decoding.
    mark = eng.recorder.mark()
    eng.recorder.wait_for(lambda m: tokens_of(ids[0], mark) >= 3 and tokens_of(ids[2], mark) >= 3)
    for job_id in (ids[0], ids[2]):
        eng.client.cancel(job_id)
        assert isinstance(eng.wait_end(job_id, timeout=5).end, JobCancelled)
    assert eng.client.in_flight == []


def test_at_most_max_batch_size_jobs_run_at_once(slow_engine: Engine) -> None:
    eng = slow_engine
    ids = [new_id("limit") for _ in range(4)]
    for job_id in ids:
        eng.client.submit(eng.job(job_id, max_tokens=6))
    runs = [eng.wait_end(job_id) for job_id in ids]
    assert all(isinstance(run.end, JobFinished) for run in runs)
    messages = [m for m in eng.recorder.messages if getattr(m, "job_id", None) in ids]
    started = [i for i, m in enumerate(messages) if isinstance(m, JobStarted)]
    first_end = next(i for i, m in enumerate(messages) if isinstance(m, END_TYPES))
    # Three start at once; the fourth only once a slot is free.
    assert sum(i < first_end for i in started) == 3
    assert messages[started[3]].job_id == ids[3]


def test_a_failing_job_does_not_disturb_the_batch(engine: Engine, tmp_path: Path) -> None:
    good = [engine.job(new_id("ok"), messages=chat(q), max_tokens=30) for q in QUESTIONS[:2]]
    reference = run_sequentially(
        engine, [engine.job(new_id("ref"), messages=chat(q), max_tokens=30) for q in QUESTIONS[:2]]
    )
    bad = engine.job(new_id("bad"), model_path=str(tmp_path / "missing"))
    invalid = engine.job(new_id("invalid"), top_p=0.0)
    runs = run_concurrently(engine, [good[0], bad, invalid, good[1]])
    assert isinstance(runs[1].end, JobFailed) and runs[1].end.code == "model_not_found"
    assert isinstance(runs[2].end, JobFailed) and runs[2].end.code == "invalid_request"
    assert_same([runs[0], runs[3]], reference)


def test_demo_model_batched_equals_sequential(
    demo_model_dir: Path, worker_blas: BlasChoice
) -> None:
    """The real float32 model on the BLAS the probe chose, as the service runs it: 4
    concurrent = 4 in a row."""
    eng = start_engine(demo_model_dir, env=worker_blas.env)
    try:
        questions = ["What is the capital of France?", *QUESTIONS[:3]]

        def jobs() -> list[GenerateJob]:
            return [eng.job(new_id("demo"), messages=chat(q), max_tokens=24) for q in questions]

        sequential = run_sequentially(eng, jobs())
        batch = jobs()
        batched = run_concurrently(eng, batch)
        assert overlapped(eng, [job.job_id for job in batch])
        assert_same(batched, sequential)
        assert "Paris" in sequential[0].text
    finally:
        eng.client.stop()


# --- resume ---------------------------------------------------------------------------------


@pytest.mark.parametrize("sampling", [{}, SEEDED], ids=["greedy", "seeded"])
def test_resumed_jobs_in_one_batch_reproduce_the_uninterrupted_run(
    engine: Engine, cold_engine: Engine, tokenizer, sampling: dict
) -> None:
    max_tokens = 48
    full = cold_engine.run(new_id(), max_tokens=max_tokens, **sampling)
    n = len(full.tokens)
    points = [1, 7, 20, 33, n - 1]
    for eng in (engine, cold_engine):  # with and without the prompt cache
        jobs = [
            eng.job(
                new_id("resume"),
                max_tokens=max_tokens,
                resume_token_ids=full.tokens[:k],
                resume_text=detokenized(tokenizer, full.tokens[:k], final=False),
                **sampling,
            )
            for k in points
        ]
        runs = run_concurrently(eng, jobs)
        for k, job, run in zip(points, jobs, runs, strict=True):
            assert isinstance(run.end, JobFinished), (k, run.end)
            assert full.tokens[:k] + run.tokens == full.tokens, k
            assert job.resume_text + run.text == full.text, k
            assert run.end.output_tokens == n


# --- prompt cache ---------------------------------------------------------------------------


def test_follow_up_turn_reuses_the_cache_and_matches_a_cold_run(
    engine: Engine, cold_engine: Engine, tokenizer
) -> None:
    first_turn = chat("Tell me about the weather in the mountains, please.")
    first = engine.run(new_id("turn1"), messages=first_turn, max_tokens=40)
    assert isinstance(first.end, JobFinished)
    assert first.started is not None and first.started.cached_tokens < first.started.input_tokens
    follow_up = [
        *first_turn,
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "And what about tomorrow?"},
    ]
    warm = engine.run(new_id("turn2"), messages=follow_up, max_tokens=40)
    cold = cold_engine.run(new_id("turn2-cold"), messages=follow_up, max_tokens=40)
    assert warm.started is not None and cold.started is not None
    assert cold.started.cached_tokens == 0
    assert warm.started.input_tokens == cold.started.input_tokens
    # At least the whole first prompt came from the cache (the reply may re-tokenize
    # differently once it is part of a prompt).
    assert warm.started.cached_tokens >= first.started.input_tokens
    assert warm.tokens == cold.tokens and warm.text == cold.text
    assert warm.end.output_tokens == cold.end.output_tokens

    # The same prompt again: everything but the last token is reused.
    again = engine.run(new_id("turn2-again"), messages=follow_up, max_tokens=40)
    assert again.started.cached_tokens == again.started.input_tokens - 1
    assert again.tokens == cold.tokens


def test_concurrent_jobs_share_a_cached_system_prompt(engine: Engine, cold_engine: Engine) -> None:
    system = {"role": "system", "content": " ".join(QUESTIONS) * 2}

    def jobs(eng: Engine) -> list[GenerateJob]:
        return [
            eng.job(new_id("shared"), messages=[system, {"role": "user", "content": q}])
            for q in QUESTIONS[:3]
        ]

    primer = engine.run(new_id("primer"), messages=[system, {"role": "user", "content": "Hi"}])
    assert primer.started.input_tokens > 200  # longer than a prefill chunk
    warm = run_concurrently(engine, jobs(engine))
    cold = run_concurrently(cold_engine, jobs(cold_engine))
    for w, c in zip(warm, cold, strict=True):
        assert w.started.cached_tokens > 200 and c.started.cached_tokens == 0
        assert w.tokens == c.tokens and w.text == c.text


def test_a_prompt_is_cached_once_prefilled_not_only_when_its_job_ends(
    slow_engine: Engine,
) -> None:
    eng = slow_engine
    system = {"role": "system", "content": "Session 42. " + " ".join(QUESTIONS) * 2}
    first = eng.job(new_id("long"), messages=[system, {"role": "user", "content": "Hi"}])
    first.max_tokens = 500
    eng.client.submit(first)
    eng.recorder.wait_for(lambda m: isinstance(m, JobTokens) and m.job_id == first.job_id)
    second = eng.run(new_id("sharer"), messages=[system, {"role": "user", "content": "Why?"}])
    assert isinstance(second.end, JobFinished)
    # Everything up to the user message came from the first job's prompt, still running.
    assert second.started.cached_tokens > 200
    assert first.job_id in eng.client.in_flight
    eng.client.cancel(first.job_id)
    assert isinstance(eng.wait_end(first.job_id).end, JobCancelled)


def test_cancel_during_prefill_keeps_the_part_read(slow_engine: Engine) -> None:
    eng = slow_engine
    # ~2000 tokens: 16 prefill steps of 128, each followed by the 50 ms test delay.
    long_prompt = [{"role": "user", "content": " ".join(QUESTIONS) * 12}]
    job_id = new_id("prefill")
    eng.client.submit(eng.job(job_id, messages=long_prompt, max_tokens=8))
    started = eng.recorder.wait_for(lambda m: isinstance(m, JobStarted) and m.job_id == job_id)
    assert started.input_tokens > 1500
    time.sleep(0.15)  # a few prefill steps in
    eng.client.cancel(job_id)
    run = eng.wait_end(job_id, timeout=5)
    assert isinstance(run.end, JobCancelled) and run.end.output_tokens == 0
    assert run.tokens == []
    # What was prefilled before the cancel is in the prompt cache.
    again = eng.run(new_id("prefill-again"), messages=long_prompt, max_tokens=8)
    assert isinstance(again.end, JobFinished)
    assert 0 < again.started.cached_tokens < started.input_tokens - 1


# --- in this process: the scheduler against bare mlx-lm ------------------------------------


def test_scheduler_matches_bare_generate_step(test_model_dir: Path) -> None:
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    from jupyter_lmsp.engine.batching import BatchScheduler
    from jupyter_lmsp.engine.prompt_cache import PromptCache
    from jupyter_lmsp.engine.sampling import make_sampler
    from jupyter_lmsp.engine.worker import encode_chat

    model, tok = load(str(test_model_dir))
    eos = tok.eos_token_ids
    prompts = [encode_chat(tok, chat(q)) for q in QUESTIONS[:4]]
    max_tokens = 40

    expected = []
    for prompt in prompts:
        tokens = []
        for token, _ in generate_step(
            mx.array(prompt), model, max_tokens=max_tokens, sampler=make_sampler(0.0)
        ):
            if token in eos:
                break
            tokens.append(token)
        expected.append(tokens)

    # A small prefill step, so prompts are prefilled over several steps between decode steps.
    scheduler = BatchScheduler(PromptCache(0), max_batch_size=4, prefill_step=8)
    got: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        job = GenerateJob(f"j{i}", str(test_model_dir), [], max_tokens=max_tokens)
        cached, updates = scheduler.add(job, "tiny", model, tok, prompt)
        assert cached == 0 and updates == []
        got[job.job_id] = []
    batch_sizes = []
    while scheduler.active:
        batch_sizes.append(scheduler.active)
        for update in scheduler.step():
            assert update.error is None
            got[update.job_id].extend(update.token_ids)
    assert max(batch_sizes) == 4
    assert [got[f"j{i}"] for i in range(4)] == expected


# --- in this process: the prompt cache ------------------------------------------------------


def _kv(tokens: int, layers: int = 2, value: float = 0.0) -> list:
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    cache = []
    for layer in range(layers):
        c = KVCache()
        keys = mx.arange(tokens, dtype=mx.float32).reshape(1, 1, tokens, 1) + value + layer
        c.update_and_fetch(mx.broadcast_to(keys, (1, 2, tokens, 4)), mx.zeros((1, 2, tokens, 4)))
        cache.append(c)
    return cache


def test_prompt_cache_prefix_matching() -> None:
    from jupyter_lmsp.engine.prompt_cache import PromptCache, common_prefix_length

    assert common_prefix_length(tuple(range(500)), (*range(300), 7)) == 300
    assert common_prefix_length((1, 2), (1, 2)) == 2
    assert common_prefix_length((), (1,)) == 0

    pc = PromptCache(1 << 30)
    tokens = list(range(10, 30))
    assert pc.insert("m", tokens, _kv(20))
    assert pc.fetch("m", [1, 2, 3]) == (None, 0)
    assert pc.fetch("other-model", tokens) == (None, 0)
    # Longer context: all 20 cached positions are reused.
    cache, n = pc.fetch("m", [*tokens, 99, 100])
    assert n == 20 and all(layer.offset == 20 for layer in cache)
    # Diverging context: the shared part.
    cache, n = pc.fetch("m", [*tokens[:12], 5, 6])
    assert n == 12 and cache[0].keys.shape[2] == 12
    # The same context: all but the last token, which must still produce logits.
    cache, n = pc.fetch("m", tokens)
    assert n == 19
    assert pc.fetch("m", tokens[:1]) == (None, 0)
    assert pc.stats().hits == 3
    # Each reused position took keys and values of every layer: 2 layers x (keys + values) x
    # 2 heads x 4 dims x 4 bytes (float32), whatever room the arrays kept for more positions.
    assert pc.stats().reused_bytes == (20 + 12 + 19) * 2 * 2 * 2 * 4 * 4


def test_prompt_cache_keeps_the_longest_entry_and_evicts_lru() -> None:
    from jupyter_lmsp.engine.prompt_cache import PromptCache, cache_nbytes

    one = cache_nbytes(_kv(10))
    pc = PromptCache(2 * one)  # KVCache allocates 256 positions at a time: two entries fit
    assert pc.insert("m", list(range(10)), _kv(10))
    # A longer entry replaces its prefix; a prefix of an entry is not stored again.
    assert pc.insert("m", list(range(12)), _kv(12))
    assert len(pc) == 1
    assert not pc.insert("m", list(range(5)), _kv(5))
    assert len(pc) == 1
    # Independent entries, least recently used evicted first.
    assert pc.insert("m", [100 + i for i in range(10)], _kv(10))
    pc.fetch("m", [*range(12), 1])  # refresh the first
    assert pc.insert("m", [200 + i for i in range(10)], _kv(10))
    assert pc.nbytes <= pc.max_bytes
    assert pc.fetch("m", [*range(100, 110), 1]) == (None, 0)
    assert pc.fetch("m", [*range(12), 1])[1] == 12
    pc.max_bytes = 0
    assert len(pc) == 0 and pc.nbytes == 0
    # Caches that cannot be cut to a prefix are not kept.
    from mlx_lm.models.cache import RotatingKVCache

    assert not PromptCache().insert("m", [1, 2], [RotatingKVCache(max_size=8)])


def test_a_fetched_cache_does_not_alias_the_entry() -> None:
    import mlx.core as mx

    from jupyter_lmsp.engine.prompt_cache import PromptCache

    pc = PromptCache()
    pc.insert("m", list(range(8)), _kv(8))
    view, n = pc.fetch("m", [0, 1, 2, 3, 9, 9])
    assert n == 4
    # Extending the view (as prefill and decoding do) leaves the stored entry intact.
    for layer in view:
        layer.update_and_fetch(mx.full((1, 2, 3, 4), 42.0), mx.full((1, 2, 3, 4), 42.0))
    again, n = pc.fetch("m", [*range(8), 1])
    assert n == 8
    keys = again[0].keys[0, 0, :, 0].tolist()
    assert keys == [float(i) for i in range(8)]


def test_batched_prefill_is_one_chunk_per_step_and_a_cancel_stops_it(test_model_dir: Path) -> None:
    """Each step reads one chunk of every prompt being prefilled (beside one decode step of the
    running rows); a cancel between steps drops the prompt before its next chunk."""
    from mlx_lm import load
    from schedrun import add, collect, job, scheduler
    from test_choices import Recording

    from jupyter_lmsp.engine.prefill import chunk_tokens
    from jupyter_lmsp.engine.speculative import OFF

    model, tok = load(str(test_model_dir))
    recording = Recording(model)
    # Counts the model's calls by shape: no verify steps (speculation) among them.
    sched = scheduler(prefill_step=16, speculation=OFF, prefill_pacing=False)
    results: dict = {}
    long_prompt = [{"role": "user", "content": " ".join(QUESTIONS) * 4}]
    add(sched, recording, tok, results, [job("runner", max_tokens=200)])
    while not results[("runner", 0)].tokens:  # decoding
        collect(results, sched.step())
    add(sched, recording, tok, results, [job("long", messages=long_prompt, max_tokens=5)])
    recording.calls.clear()
    for _ in range(3):
        collect(results, sched.step())
    # Per step: the runner's decode step, and one chunk of the long prompt, sized for its cost
    # beside a decoding row (16 tokens at first, fewer as the context grows: `prefill`).
    chunks, read = [], 0
    for _ in range(3):
        chunks.append(chunk_tokens(read, 16))
        read += chunks[-1]
    assert chunks[0] == 16 and chunks[-1] < 16
    assert recording.calls == [call for size in chunks for call in [(1, 1), (1, size)]]
    assert sched.cancel("long") == 0 and sched.cancel("long") is None
    recording.calls.clear()
    collect(results, sched.step())
    assert recording.calls == [(1, 1)]  # only the runner's decode step
    sched.cancel("runner")
    assert not sched.active
