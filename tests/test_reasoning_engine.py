"""The engine side of reasoning (issue 37): effort as the template's switch, a thinking budget,
grammars that apply after the thinking block.

On the thinking test model (tests/thinkingmodel.py: `<think>` / `</think>` special tokens, a
template that honours `enable_thinking`; random weights): effort "none" renders the prompt with
a closed, empty block and "high" with an open one; an effort a model without thinking cannot
take is refused (the worker's `unsupported_reasoning_effort`, the server's 400
`unsupported_parameter` naming what it can take); a budget closes each row's block after its own number of tokens, batched, and the
answer follows; a JSON schema lets the model think, then holds the answer to the schema; a job
resumed mid-thinking (re-prefilled, as after a kill -9) continues exactly.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from schedrun import streamed_text
from serverproc import ServerProcess
from test_engine import Engine, new_id, start_engine
from thinkingmodel import make_thinking_model

from jupyter_lmsp.engine.messages import JobFailed, JobFinished
from jupyter_lmsp.engine.reasoning import (
    EFFORTS,
    EffortRefused,
    ThinkingBudget,
    after_thinking,
    effort_args,
)
from jupyter_lmsp.engine.thinking import Thinking
from jupyter_lmsp.engine.worker import encode_chat, reasoning_args

pytestmark = pytest.mark.timeout(300)

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}},
    "required": ["city", "n"],
    "additionalProperties": False,
}
JSON_FORMAT = {"type": "json_schema", "schema": SCHEMA, "strict": True}
SEEDED = {"temperature": 0.9, "top_p": 0.95, "seed": 77}
# The server's `max_reasoning_tokens` trait in the server tests.
DEFAULT_BUDGET = 2


@pytest.fixture(scope="module")
def opens_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The template opens the block when thinking is on."""
    return make_thinking_model(tmp_path_factory.mktemp("thinking-opens"))


@pytest.fixture(scope="module")
def leaves_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The template leaves the model to open the block."""
    return make_thinking_model(tmp_path_factory.mktemp("thinking-leaves"), opens=False)


@pytest.fixture(scope="module")
def thinker(opens_dir: Path) -> Any:
    from mlx_lm import load

    return load(str(opens_dir))[1]


@pytest.fixture(scope="module")
def engine(opens_dir: Path) -> Iterator[Engine]:
    eng = start_engine(opens_dir)
    yield eng
    eng.client.stop()


def end_id(tokenizer: Any) -> int:
    return int(tokenizer.think_end_tokens[0])


def answer_of(tokenizer: Any, tokens: list[int]) -> str:
    """The text after the first end marker."""
    at = tokens.index(end_id(tokenizer))
    return str(tokenizer.decode(tokens[at + 1 :]))


# --- effort ---------------------------------------------------------------------------------


def test_effort_none_renders_without_thinking_and_high_with(thinker: Any) -> None:
    messages = [{"role": "user", "content": "Hello"}]
    rendered = {
        effort: thinker.decode(encode_chat(thinker, messages, **reasoning_args(thinker, effort)))
        for effort in (None, "none", "minimal", "low", "high", "xhigh")
    }
    for effort in ("none", "minimal"):
        assert rendered[effort].endswith("<|assistant|>\n<think>\n\n</think>\n\n"), effort
    for effort in (None, "low", "high", "xhigh"):
        assert rendered[effort].endswith("<|assistant|>\n<think>\n"), effort
    assert effort_args(thinker, "none") == {"enable_thinking": False}
    assert effort_args(thinker, "medium") == {"enable_thinking": True}


def test_the_worker_reports_the_block_the_effort_opened(engine: Engine, thinker: Any) -> None:
    off = engine.run(new_id(), max_tokens=4, reasoning_effort="none")
    on = engine.run(new_id(), max_tokens=4, reasoning_effort="high")
    assert isinstance(off.end, JobFinished) and isinstance(on.end, JobFinished)
    assert off.started is not None and on.started is not None
    assert off.started.input_tokens > on.started.input_tokens  # "\n\n</think>\n\n" more
    assert off.started.thinking is not None and off.started.thinking.open is False
    assert on.started.thinking is not None and on.started.thinking.open is True


def test_a_template_with_reasoning_effort_gets_the_level() -> None:
    class GptOss:
        has_thinking = False
        chat_template = "{% if reasoning_effort is defined %}Reasoning: {{ reasoning_effort }}"

    assert effort_args(GptOss(), "high") == {"reasoning_effort": "high"}
    assert effort_args(GptOss(), "xhigh") == {"reasoning_effort": "high"}
    assert effort_args(GptOss(), "minimal") == {"reasoning_effort": "low"}
    assert effort_args(GptOss(), None) == {}


def test_a_model_that_cannot_think_takes_only_none(tokenizer: Any, test_model_dir: Path) -> None:
    assert effort_args(tokenizer, "none") == {} and effort_args(tokenizer, "minimal") == {}
    for effort in EFFORTS[2:]:
        with pytest.raises(EffortRefused) as refused:
            effort_args(tokenizer, effort)
        assert refused.value.allowed == ("none", "minimal")
        assert "'none' or 'minimal'" in str(refused.value)
    eng = start_engine(test_model_dir)
    try:
        failed = eng.run(new_id(), max_tokens=4, reasoning_effort="high")
        assert isinstance(failed.end, JobFailed), failed.end
        assert failed.end.code == "unsupported_reasoning_effort"
        assert isinstance(eng.run(new_id(), max_tokens=4, reasoning_effort="none").end, JobFinished)
    finally:
        eng.client.stop()


# --- the budget -----------------------------------------------------------------------------


def test_the_budget_processor_counts_the_block_and_forces_the_end() -> None:
    thinking = Thinking("<a>", "</a>", (7,), (8, 9))
    budget = ThinkingBudget(thinking, 2)
    assert budget.next_forced() is None
    for token in (7, 1, 2):
        budget._feed(token)
    assert budget.next_forced() == 8
    budget._feed(8)
    assert budget.next_forced() == 9
    budget._feed(9)
    assert budget.closed and budget.next_forced() is None
    # Resumed mid-block: the count goes on from the resumed tokens.
    resumed = ThinkingBudget(thinking, 3, resumed=[7, 1, 2])
    assert resumed.inside == 2 and resumed.next_forced() is None
    # An answer without a block is never touched.
    plain = ThinkingBudget(thinking, 0, resumed=[1])
    assert plain.closed and plain.next_forced() is None
    opened = ThinkingBudget(Thinking("<a>", "</a>", (7,), (8,), open=True), 0)
    assert opened.next_forced() == 8


def test_budgets_close_each_rows_block_and_the_answer_follows(engine: Engine, thinker: Any) -> None:
    end = end_id(thinker)
    # Where the model closes its block by itself (with this seed, within 40 tokens).
    free = engine.run(new_id(), max_tokens=40, **SEEDED)
    natural = free.tokens.index(end) if end in free.tokens else 40
    budgets = [0, 3, 9, natural + 5]
    ids = [new_id("budget") for _ in budgets]
    for job_id, budget in zip(ids, budgets, strict=True):
        engine.client.submit(
            engine.job(job_id, max_tokens=40, max_reasoning_tokens=budget, **SEEDED)
        )
    runs = [engine.wait_end(job_id) for job_id in ids]
    batched = False
    for budget, run in zip(budgets, runs, strict=True):
        assert isinstance(run.end, JobFinished), run.end
        tokens = run.tokens
        assert end in tokens, (budget, tokens)
        at = tokens.index(end)
        # The block closes at its budget (or where the model closes it, if sooner), and the
        # row's thinking is the one it thinks without a budget up to there.
        assert at == min(budget, natural), (budget, natural, tokens)
        assert tokens[:at] == free.tokens[:at]
        assert len(tokens) > at + 1, "the answer follows the block"
        assert run.end.reasoning_tokens == at + 1  # the block (opened by the prompt) and its end
        batched = batched or any(
            size > 1 for chunk in run.chunks for size in (chunk.batch_sizes or [])
        )
    assert batched, "the jobs decoded together"


# --- grammars after thinking ----------------------------------------------------------------


def test_the_wrapped_grammar_starts_inside_an_opened_block(thinker: Any) -> None:
    import llguidance.hf

    from jupyter_lmsp.engine.constraints import compile_grammar
    from jupyter_lmsp.engine.grammars import ResponseFormat, build_grammar

    ll = llguidance.hf.from_tokenizer(thinker._tokenizer, eos_token=sorted(thinker.eos_token_ids))
    grammar = build_grammar(ResponseFormat("json_schema", SCHEMA, True), None)
    assert grammar is not None
    start, end = thinker.think_start_tokens[0], end_id(thinker)
    text = thinker.encode('I think {"city": 1} is wrong.', add_special_tokens=False)
    answer = thinker.encode('\n\n{"city": "Rome", "n": 3}', add_special_tokens=False)
    for opened, head in ((True, []), (False, [start])):
        thinking = Thinking("<think>", "</think>", (start,), (end,), opened)
        matcher = compile_grammar(ll, after_thinking(grammar, thinking))
        assert matcher.consume_tokens([*head, *text, end, *answer]), matcher.get_error()
        assert matcher.is_accepting()
    # Not opened: thinking is optional, the schema alone is an answer.
    matcher = compile_grammar(ll, after_thinking(grammar, thinking))
    assert matcher.consume_tokens(thinker.encode('{"city": "x", "n": 1}', add_special_tokens=False))
    # Opened: the answer cannot begin before the block ends... it is thinking text until then.
    opened = Thinking("<think>", "</think>", (start,), (end,), True)
    matcher = compile_grammar(ll, after_thinking(grammar, opened))
    assert matcher.consume_tokens(thinker.encode('{"city": "x", "n": 1}', add_special_tokens=False))
    assert not matcher.is_accepting()


@pytest.mark.parametrize("model", ["opens", "leaves"])
def test_a_schema_on_a_thinking_model_thinks_then_answers_in_the_schema(
    model: str, opens_dir: Path, leaves_dir: Path, thinker: Any
) -> None:
    from jupyter_lmsp.engine.grammars import ResponseFormat

    eng = engine_for(opens_dir if model == "opens" else leaves_dir)
    try:
        fmt = ResponseFormat("json_schema", SCHEMA, True)
        for seed in range(3):
            run = eng.run(
                new_id(),
                max_tokens=120,
                max_reasoning_tokens=12,
                response_format=fmt,
                temperature=0.9,
                seed=seed,
            )
            assert isinstance(run.end, JobFinished), run.end
            assert run.end.finish_reason == "stop", run.end
            tokens = run.tokens
            if model == "opens":
                assert tokens.index(end_id(thinker)) <= 12
            if end_id(thinker) in tokens:
                answer = answer_of(thinker, tokens)
            else:  # the model (not opened) answered at once
                answer = str(thinker.decode(tokens))
            jsonschema.validate(json.loads(answer), SCHEMA)
    finally:
        eng.client.stop()


def engine_for(model_dir: Path) -> Engine:
    return start_engine(model_dir)


@pytest.mark.parametrize("sampling", [{}, SEEDED], ids=["greedy", "seeded"])
def test_a_job_resumed_mid_thinking_continues_exactly(
    engine: Engine, thinker: Any, sampling: dict[str, Any]
) -> None:
    from jupyter_lmsp.engine.grammars import ResponseFormat

    job = {
        "max_tokens": 90,
        "max_reasoning_tokens": 10,
        "response_format": ResponseFormat("json_schema", SCHEMA, True),
        **sampling,
    }
    full = engine.run(new_id(), **job)
    assert isinstance(full.end, JobFinished), full.end
    n = len(full.tokens)
    at = full.tokens.index(end_id(thinker))
    for k in sorted({1, 5, at - 1, at, at + 1, at + 3, n - 1}):
        resume_text = streamed_text(thinker, full.tokens[:k])
        resumed = engine.run(
            new_id(), resume_token_ids=full.tokens[:k], resume_text=resume_text, **job
        )
        assert isinstance(resumed.end, JobFinished), (k, resumed.end)
        assert full.tokens[:k] + resumed.tokens == full.tokens, k
        assert resume_text + resumed.text == full.text, k
        assert resumed.end.reasoning_tokens == full.end.reasoning_tokens, k


# --- through a server -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, test_model_dir: Path, opens_dir: Path
) -> Iterator[ServerProcess]:
    data_dir = tmp_path_factory.mktemp("reasoning-server")
    (data_dir / "models").mkdir()
    (data_dir / "models" / "tiny").symlink_to(test_model_dir)
    (data_dir / "models" / "thinker").symlink_to(opens_dir)
    # The owner's budget for requests that give none.
    server = ServerProcess(data_dir, default_model="tiny", max_reasoning_tokens=DEFAULT_BUDGET)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with server.client() as c:
        yield c


@pytest.mark.parametrize("path", ["/responses", "/chat/completions"])
@pytest.mark.slow  # the module's server subprocess
def test_an_effort_the_model_cannot_take_is_a_400_naming_what_it_can(
    http: httpx.Client, path: str
) -> None:
    if path == "/responses":
        body: dict[str, Any] = {"model": "tiny", "input": "Hi", "reasoning": {"effort": "high"}}
        param = "reasoning.effort"
    else:
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "Hi"}],
            "reasoning_effort": "high",
        }
        param = "reasoning_effort"
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert error["code"] == "unsupported_parameter", error
    assert "'none' or 'minimal'" in error["message"], error


@pytest.mark.slow  # the module's server subprocess
def test_responses_take_an_effort_and_a_budget_and_echo_the_effort(http: httpx.Client) -> None:
    body = {
        "model": "thinker",
        "input": "Hi",
        "max_output_tokens": 30,
        "reasoning": {"effort": "low"},
        "max_reasoning_tokens": 4,
        "temperature": 0,
    }
    r = http.post("/responses", json=body)
    assert r.status_code == 200, r.text
    response = r.json()
    assert response["reasoning"]["effort"] == "low"
    assert response["usage"]["output_tokens_details"]["reasoning_tokens"] == 5, response["usage"]
    # Effort none on a model that cannot think is what it does anyway.
    r = http.post(
        "/responses",
        json={
            "model": "tiny",
            "input": "Hi",
            "max_output_tokens": 4,
            "reasoning": {"effort": "none"},
        },
    )
    assert r.status_code == 200, r.text


@pytest.mark.slow  # the module's server subprocess
def test_chat_completions_take_an_effort_and_a_budget(http: httpx.Client) -> None:
    body = {
        "model": "thinker",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 30,
        "reasoning_effort": "medium",
        "max_reasoning_tokens": 6,
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}},
    }
    r = http.post("/chat/completions", json=body)
    assert r.status_code == 200, r.text
    completion = r.json()
    assert completion["usage"]["completion_tokens_details"]["reasoning_tokens"] == 7


@pytest.mark.slow  # the module's server subprocess
def test_the_owners_budget_applies_when_a_request_gives_none(http: httpx.Client) -> None:
    body = {"model": "thinker", "input": "Hi", "max_output_tokens": 20, "temperature": 0}
    r = http.post("/responses", json=body)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    # The block the prompt opened: the budget's tokens, then the end marker.
    assert usage["output_tokens_details"]["reasoning_tokens"] == DEFAULT_BUDGET + 1, usage


def test_the_grammar_leaves_the_thinking_free_and_resumes_exactly(
    engine: Engine, thinker: Any
) -> None:
    """No budget: the model thinks as long as it likes (the grammar allows any text until the
    end marker it writes itself), then answers in the schema. The row speculates under its
    grammar (one processor), and resumes exactly, mid-thinking too."""
    from jupyter_lmsp.engine.grammars import ResponseFormat

    end = end_id(thinker)
    job = {"max_tokens": 120, "response_format": ResponseFormat("json_schema", SCHEMA, True)}
    # A seed whose thinking ends by itself (the grammar masks the tokens it cannot take, so
    # the sampled thinking is not the unconstrained run's).
    for seed in range(12):
        full = engine.run(new_id(), **job, temperature=0.9, seed=seed)
        done = isinstance(full.end, JobFinished) and full.end.finish_reason == "stop"
        if done and end in full.tokens:
            break
    else:
        raise AssertionError("no seed's thinking ended by itself")
    sampling = {"temperature": 0.9, "seed": seed}
    jsonschema.validate(json.loads(answer_of(thinker, full.tokens)), SCHEMA)
    at, n = full.tokens.index(end), len(full.tokens)
    for k in sorted({3, at, at + 1, (at + n) // 2, n - 1}):
        resume_text = streamed_text(thinker, full.tokens[:k])
        resumed = engine.run(
            new_id(), resume_token_ids=full.tokens[:k], resume_text=resume_text, **job, **sampling
        )
        assert isinstance(resumed.end, JobFinished), (k, resumed.end)
        assert full.tokens[:k] + resumed.tokens == full.tokens, k
