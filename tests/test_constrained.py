"""Grammar-constrained decoding inside continuous batching (`engine.constraints`).

The corpus (tests/schema_corpus.py, 35 schemas): every output generated under each schema
validates with `jsonschema` (its format checker too), decoded 8 rows at a time with
unconstrained jobs mixed in (which must come out exactly as when run alone: no mask leaks
between rows). The whole corpus runs on the test model (greedy and seeded); a representative
share of 6 schemas runs on the demo model (SmolLM2-135M) through the worker process, because
each of its steps costs ~100× the test model's. Then: matchers follow their jobs as rows move,
resumed constrained jobs equal uninterrupted ones, a failing matcher fails its job (never
continuing unconstrained), grammars that do not compile are refused, and the demo model
completes a tool loop.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft202012Validator, FormatChecker
from schedrun import add, collect, job, run, scheduler, streamed_text
from schema_corpus import CORPUS
from test_engine import new_id, start_engine

from jupyter_lmsp.engine.blas import BlasChoice
from jupyter_lmsp.engine.grammars import (
    FunctionTool,
    ResponseFormat,
    ToolSpec,
    build_grammar,
    check_response_format,
)
from jupyter_lmsp.engine.messages import JobFailed, JobFinished, JobStarted
from jupyter_lmsp.engine.toolcalls import CallDone, ContentDelta, ToolCallParser

pytestmark = pytest.mark.timeout(300)

# RFC 3339 in full, as llguidance generates it: "t"/"z" in either case (RFC 3339 §5.6 NOTE)
# and leap seconds (§5.7); jsonschema's rfc3339-validator accepts neither.
_TIME = r"([01]\d|2[0-3]):[0-5]\d:([0-5]\d|60)(\.\d+)?([Zz]|[+-]([01]\d|2[0-3]):[0-5]\d)"
FORMATS = FormatChecker()
FORMATS.checks("date-time")(
    lambda s: (
        not isinstance(s, str)
        or bool(re.fullmatch(r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])[Tt]" + _TIME, s))
    )
)
FORMATS.checks("time")(lambda s: not isinstance(s, str) or bool(re.fullmatch(_TIME, s)))
for name in ("date", "uuid", "ipv4", "email"):
    FORMATS.checkers[name] = Draft202012Validator.FORMAT_CHECKER.checkers[name]

UNCONSTRAINED = [
    [{"role": "user", "content": "What is the weather like today in the mountains?"}],
    [{"role": "user", "content": "Python is a programming language. Is it?"}],
]


def grammar_of(schema: dict[str, Any]) -> str:
    fmt = ResponseFormat("json_schema", schema, strict=True)
    assert check_response_format(fmt) is None
    grammar = build_grammar(fmt, None)
    assert grammar is not None
    return grammar


def assert_valid(schema: dict[str, Any], text: str, where: str) -> None:
    value = json.loads(text)
    errors = list(Draft202012Validator(schema, format_checker=FORMATS).iter_errors(value))
    assert not errors, f"{where}: {errors[0].message} in {text!r}"


def test_the_corpus_is_large_and_compiles() -> None:
    assert len(CORPUS) >= 30
    for name, schema in CORPUS.items():
        assert check_response_format(ResponseFormat("json_schema", schema, strict=True)) is None, (
            name
        )
        Draft202012Validator.check_schema(schema)


@pytest.mark.parametrize(
    "sampling", [{}, {"temperature": 1.0, "seed": 17}], ids=["greedy", "seeded"]
)
def test_corpus_outputs_validate_on_the_test_model(tiny, sampling: dict) -> None:
    model, tok = tiny
    names = list(CORPUS)
    free_alone = run(
        model,
        tok,
        [job(f"alone{i}", messages=m, max_tokens=60) for i, m in enumerate(UNCONSTRAINED)],
    )
    for start in range(0, len(names), 6):
        group = names[start : start + 6]
        jobs = [job(name, max_tokens=400, **sampling) for name in group]
        jobs += [job(f"free{i}", messages=m, max_tokens=60) for i, m in enumerate(UNCONSTRAINED)]
        grammars: dict[str, str | None] = {name: grammar_of(CORPUS[name]) for name in group}
        results = run(model, tok, jobs, grammars, sched=scheduler(max_batch_size=8))
        for name in group:
            result = results[(name, 0)]
            assert result.finish_reason == "stop", (name, result.text[-80:])
            assert_valid(CORPUS[name], result.text, name)
        for i in range(len(UNCONSTRAINED)):
            assert results[(f"free{i}", 0)].tokens == free_alone[(f"alone{i}", 0)].tokens


def test_matchers_follow_their_jobs_as_rows_move(tiny) -> None:
    """Jobs join, leave (cancelled) and end while others decode: each constrained job's output
    is exactly its output when run alone."""
    model, tok = tiny
    names = ["person", "matrix", "ref_defs", "pattern", "tuple", "nested"]
    grammars = {name: grammar_of(CORPUS[name]) for name in names}
    alone = {
        name: run(model, tok, [job(name, max_tokens=400)], grammars)[(name, 0)] for name in names
    }
    sched = scheduler(max_batch_size=8)
    results: dict = {}
    add(
        sched,
        model,
        tok,
        results,
        [job("person", max_tokens=400), job("victim", max_tokens=400)],
        {"victim": grammars["matrix"], **grammars},
    )
    for step in range(60):
        collect(results, sched.step())
        if step == 3:
            add(
                sched,
                model,
                tok,
                results,
                [job("matrix", max_tokens=400), job("ref_defs", max_tokens=400)],
                grammars,
            )
        if step == 6:
            sched.cancel("victim")
        if step == 9:
            add(sched, model, tok, results, [job(n, max_tokens=400) for n in names[3:]], grammars)
    while sched.active:
        collect(results, sched.step())
    for name in names:
        assert results[(name, 0)].tokens == alone[name].tokens, name
        assert_valid(CORPUS[name], results[(name, 0)].text, name)


@pytest.mark.parametrize(
    "sampling", [{}, {"temperature": 1.0, "seed": 5}], ids=["greedy", "seeded"]
)
def test_a_resumed_constrained_job_equals_the_uninterrupted_one(tiny, sampling: dict) -> None:
    model, tok = tiny
    grammar = grammar_of(CORPUS["array_of_objects"])
    full = run(model, tok, [job("full", max_tokens=400, **sampling)], grammar)[("full", 0)]
    n = len(full.tokens)
    assert full.finish_reason == "stop" and n > 20
    for k in sorted({1, 2, n // 3, n // 2, n - 1, n}):
        resumed = run(
            model,
            tok,
            [
                job(
                    new_id("resumed"),
                    max_tokens=400,
                    resume_token_ids=full.tokens[:k],
                    resume_text=streamed_text(tok, full.tokens[:k]),
                    **sampling,
                )
            ],
            grammar,
        )
        (result,) = resumed.values()
        assert full.tokens[:k] + result.tokens == full.tokens, k
        assert streamed_text(tok, full.tokens[:k]) + result.text == full.text, k
        assert result.finish_reason == "stop"


def test_a_failing_matcher_fails_its_job_and_only_it(tiny) -> None:
    from jupyter_lmsp.engine.constraints import Constraint, ConstraintError, ll_tokenizer

    model, tok = tiny
    grammar = grammar_of(CORPUS["person"])
    sched = scheduler()
    results: dict = {}
    add(
        sched,
        model,
        tok,
        results,
        [job("doomed", max_tokens=400), job("bystander", max_tokens=30)],
        {"doomed": grammar},
    )
    for _ in range(4):
        collect(results, sched.step())
    before = len(results[("doomed", 0)].tokens)
    # Push the matcher into its error state, as an internal llguidance failure would.
    constraint = next(c.constraint for c in sched._jobs["doomed"].choices)
    assert constraint is not None
    constraint._matcher.consume_token(tok.encode("zzz", add_special_tokens=False)[0])
    while sched.active:
        collect(results, sched.step())
    doomed = results[("doomed", 0)]
    assert doomed.updates[-1].error is not None
    assert doomed.updates[-1].error_code == "constraint_failed"
    # Nothing past the last valid token came out.
    assert len(doomed.tokens) <= before + 1
    assert results[("bystander", 0)].finish_reason == "length"

    # The processor itself: on error, only EOS is left.
    import mlx.core as mx

    ll = ll_tokenizer("m", model, tok)
    broken = Constraint(ll, grammar)
    logits = mx.zeros((1, 500))
    broken(mx.array([1]), logits)  # first call: the prompt's last token is not fed
    bad = tok.encode("zz", add_special_tokens=False)[0]
    masked = broken(mx.array([bad]), logits)
    assert broken.error
    allowed = [i for i, v in enumerate(masked[0].tolist()) if v != float("-inf")]
    assert allowed == [ll.eos_token]
    with pytest.raises(ConstraintError):
        Constraint(ll, grammar, resumed=tok.encode("not json", add_special_tokens=False))


def test_bitmask_application_on_the_cpu() -> None:
    import mlx.core as mx
    import numpy as np

    from jupyter_lmsp.engine.constraints import apply_bitmask

    bitmask = np.zeros((1, 2), dtype=np.int32)
    bitmask.view(np.uint32)[0, 0] = (1 << 3) | (1 << 31)
    bitmask.view(np.uint32)[0, 1] = 1 << 1  # token 33
    logits = mx.arange(40, dtype=mx.float32)[None]
    out = apply_bitmask(logits, bitmask)[0].tolist()
    assert [i for i, v in enumerate(out) if v != float("-inf")] == [3, 31, 33]
    assert out[33] == 33.0
    # A vocabulary wider than the bitmask: the tokens past it are masked.
    wide = apply_bitmask(mx.zeros((1, 80)), bitmask)[0].tolist()
    assert [i for i, v in enumerate(wide) if v != float("-inf")] == [3, 31, 33]


def test_a_verify_steps_masks_are_each_positions_own(tiny) -> None:
    """`mask_verify_step` masks each constrained row's positions with the mask its matcher
    gives after the draft tokens before it (as feeding them one per step would), leaves the
    matcher where it was, and leaves other rows, padding positions and failed rows right."""
    import mlx.core as mx
    import numpy as np

    from jupyter_lmsp.engine.constraints import Constraint, ll_tokenizer, mask_verify_step

    model, tok = tiny
    ll = ll_tokenizer("m", model, tok)
    grammar = grammar_of(CORPUS["person"])
    text = '{"name": "ann", "age": 42}'
    ids = tok.encode(text, add_special_tokens=False)
    vocab = model.args.vocab_size
    width = 5

    def reference(before: list[int], draft: list[int]) -> list[set[int]]:
        """The allowed tokens at each position, one step at a time."""
        one = Constraint(ll, grammar, resumed=before)
        allowed = []
        for token in [None, *draft]:
            if token is not None:
                assert one._matcher.consume_token(token)
            bits = np.zeros((1, one._words), dtype=np.int32)
            one._fill(bits, 0)
            unpacked = np.unpackbits(bits.view(np.uint8), bitorder="little")[:vocab]
            allowed.append({int(i) for i in np.flatnonzero(unpacked)})
        return allowed

    # Row 0: a draft of 4 (the first token fed by `begin` as the step's input); row 1: no
    # grammar; row 2: a grammar without a draft; row 3: a failed matcher.
    rows = []
    constraints = [Constraint(ll, grammar) for _ in range(3)]
    for c in constraints:
        c.begin([], 0)  # the first call: the prompt's last token, not fed
    constraints[0].begin([], ids[0])
    draft = ids[1:5]
    assert constraints[0].valid_prefix(draft) == 4
    assert (
        constraints[0].valid_prefix([*ids[1:3], tok.encode("zz", add_special_tokens=False)[0]]) == 2
    )
    constraints[1].begin(ids[:2], ids[2])
    constraints[2].begin([], ids[0])
    constraints[2]._matcher.consume_token(tok.encode("zzz", add_special_tokens=False)[0])
    rows = [(0, constraints[0], draft), (2, constraints[1], []), (3, constraints[2], ids[1:3])]
    logits = mx.random.normal((4, width, vocab))
    masked = np.array(mask_verify_step(logits, rows))
    free = np.isfinite(masked)
    want0 = reference(ids[:1], draft)
    for j in range(width):
        got = {int(i) for i in np.flatnonzero(free[0, j])}
        assert got == (want0[j] if j < 5 else set(range(vocab))), j
    assert free[1].all() and np.array_equal(masked[1], np.array(logits[1]))
    want2 = reference(ids[:3], [])
    assert {int(i) for i in np.flatnonzero(free[2, 0])} == want2[0]
    assert free[2, 1:].all()
    assert constraints[2].error
    assert [{int(i) for i in np.flatnonzero(free[3, j])} for j in range(3)] == [{ll.eos_token}] * 3
    # The matchers were rolled back: the draft's tokens are still allowed from the start.
    assert constraints[0].valid_prefix(draft) == 4
    assert not constraints[0].error and not constraints[1].error


def test_constraints_through_the_worker(test_model_dir: Path) -> None:
    eng = start_engine(test_model_dir)
    try:
        fmt = ResponseFormat("json_schema", CORPUS["ref_defs"], strict=True)
        run_ = eng.run(new_id("json"), max_tokens=400, response_format=fmt)
        assert isinstance(run_.end, JobFinished) and run_.end.finish_reason == "stop"
        assert_valid(CORPUS["ref_defs"], run_.text, "worker")
        assert run_.started is not None and run_.started.tool_format is None
        # A schema the compiler refuses fails the job cleanly (the server checks first).
        bad = ResponseFormat("json_schema", {"type": "string", "format": "iban"}, strict=True)
        failed = eng.run(new_id("bad"), response_format=bad)
        assert isinstance(failed.end, JobFailed) and failed.end.code == "grammar_invalid"
        assert "iban" in failed.end.message
        # Tools: the generic format on a model whose template knows none.
        tools = ToolSpec(
            (FunctionTool("lookup", None, CORPUS["person"]),), "required", parallel=False
        )
        called = eng.run(new_id("tool"), max_tokens=400, tools=tools)
        assert isinstance(called.started, JobStarted) and called.started.tool_format == "generic"
        assert isinstance(called.end, JobFinished) and called.end.finish_reason == "stop"
        parser = ToolCallParser(names={"lookup"})
        events = parser.feed(called.text) + parser.finish()
        (done,) = [e for e in events if isinstance(e, CallDone)]
        assert_valid(CORPUS["person"], done.arguments, "tool arguments")
    finally:
        eng.client.stop()


# --- the demo model ---------------------------------------------------------------------------

DEMO_SHARE = ["person", "enum", "ref_defs", "pattern", "date", "array_of_objects"]


@pytest.fixture(scope="module")
def demo(demo_model_dir: Path, worker_blas: BlasChoice):  # type: ignore[no-untyped-def]
    eng = start_engine(demo_model_dir, env=worker_blas.env)
    yield eng
    eng.client.stop()


def test_corpus_share_validates_on_the_demo_model(demo) -> None:
    jobs = []
    for i, name in enumerate(DEMO_SHARE):
        ask = f"Reply with JSON that follows this schema: {json.dumps(CORPUS[name])}"
        jobs.append(
            demo.job(
                new_id(name),
                messages=[{"role": "user", "content": ask}],
                max_tokens=72,
                response_format=ResponseFormat("json_schema", CORPUS[name], strict=True),
                **({"temperature": 0.7, "seed": i} if i % 2 else {}),
            )
        )
    jobs += [demo.job(new_id("free"), messages=m, max_tokens=24) for m in UNCONSTRAINED]
    for j in jobs:
        demo.client.submit(j)
    runs = [demo.wait_end(j.job_id, timeout=280) for j in jobs]
    for name, run_ in zip(DEMO_SHARE, runs, strict=False):
        assert isinstance(run_.end, JobFinished) and run_.end.finish_reason == "stop", (
            name,
            run_.text,
        )
        assert_valid(CORPUS[name], run_.text, name)
    for run_ in runs[len(DEMO_SHARE) :]:
        assert isinstance(run_.end, JobFinished) and run_.text


def slow_run(eng: Any, job_id: str, **kwargs: Any) -> Any:
    """`Engine.run` with time for the demo model on a busy machine."""
    eng.client.submit(eng.job(job_id, **kwargs))
    return eng.wait_end(job_id, timeout=240)


WEATHER = FunctionTool(
    "get_weather",
    "Get the current weather in a city.",
    {
        "type": "object",
        "properties": {"city": {"type": "string", "description": "The city name"}},
        "required": ["city"],
        "additionalProperties": False,
    },
)


def test_the_demo_model_completes_a_tool_loop(demo) -> None:
    """The model asks for the weather (a required call: SmolLM2-135M never calls a tool on its
    own), gets the result, and answers in text with it (tool_choice "auto")."""
    question = {"role": "user", "content": "What is the weather like in Paris right now?"}
    one_call = ToolSpec((WEATHER,), "required", parallel=False)
    ask = slow_run(demo, new_id("ask"), messages=[question], max_tokens=60, tools=one_call)
    assert isinstance(ask.end, JobFinished) and ask.end.finish_reason == "stop", ask.text
    assert ask.started is not None and ask.started.tool_format == "generic"
    parser = ToolCallParser(names={"get_weather"})
    events = parser.feed(ask.text) + parser.finish()
    calls = [e for e in events if isinstance(e, CallDone)]
    assert len(calls) == 1, ask.text
    assert json.loads(calls[0].arguments) == {"city": "Paris"}
    history = [
        question,
        {
            "role": "assistant",
            "content": "".join(e.text for e in events if isinstance(e, ContentDelta)),
            "tool_calls": [
                {"id": "call_1", "name": "get_weather", "arguments": calls[0].arguments}
            ],
        },
        {
            "role": "tool",
            "tool_call_id": "call_1",
            "content": '{"temperature_c": 18, "sky": "sunny"}',
        },
    ]
    answer = slow_run(
        demo, new_id("answer"), messages=history, max_tokens=48, tools=ToolSpec((WEATHER,), "auto")
    )
    assert answer.started is not None and answer.started.tool_format == "generic"
    assert isinstance(answer.end, JobFinished), answer.end
    parser = ToolCallParser(names={"get_weather"})
    events = parser.feed(answer.text) + parser.finish()
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    assert not any(isinstance(e, CallDone) for e in events), answer.text
    assert content.strip()
    assert "18" in content or "sunny" in content.lower(), content
