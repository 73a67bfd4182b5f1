"""Presence and frequency penalties (issue 36): OpenAI's formula, applied in the engine.

In this process, `BatchScheduler` on the tiny test model against a reference loop that calls
the model directly and applies `logits[t] -= frequency * count(t) + presence * (count(t) > 0)`
by hand, counting the generated tokens only: greedy, seeded, with a grammar, and the prompt
left out of the counts. Rows with different penalties in one batch (beside rows that
speculate) give each the tokens it gives alone. Through the worker process: a job resumed from
the first k tokens (re-prefilled, as after a kill -9) continues exactly as the uninterrupted
run, greedy and seeded; out-of-range values fail the job. Through a real server: `POST
/responses` and `/chat/completions` accept the penalties, apply them and echo them; 2.5, -2.5
and "x" are 400s naming the field; the OpenAPI document states the range.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import mlx.core as mx
import numpy as np
import pytest
from schedrun import CHAT, FORCED, Result, job, run, run_one, scheduler, streamed_text
from sdkserver import MODEL, sdk_server
from serverproc import ServerProcess
from test_engine import Engine, new_id, start_engine

from jupyter_lmsp.engine.constraints import Constraint, ll_tokenizer
from jupyter_lmsp.engine.grammars import ResponseFormat, build_grammar
from jupyter_lmsp.engine.messages import JobFailed, JobFinished
from jupyter_lmsp.engine.sampling import make_sampler
from jupyter_lmsp.engine.speculative import OFF
from jupyter_lmsp.engine.worker import encode_chat
from jupyter_lmsp.protocol.params import TaskParams

pytestmark = pytest.mark.timeout(300)

# Long enough for the unpenalized greedy run of the test model to fall into a loop.
LONG = 160
SEEDED = {"temperature": 0.8, "top_p": 0.95, "seed": 4321}
# Penalties exactly representable in binary, so the hand-made reference computes the same
# float32 numbers as the engine.
CASES = {
    "frequency": {"frequency_penalty": 2.0},
    "presence": {"presence_penalty": 1.5},
    "both-signs": {"presence_penalty": -0.5, "frequency_penalty": 1.25},
    "seeded": {"presence_penalty": 0.5, "frequency_penalty": 1.0, **SEEDED},
}


def repeats(tokens: list[int]) -> int:
    return len(tokens) - len(set(tokens))


def reference(
    model: Any,
    tokenizer: Any,
    *,
    max_tokens: int,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    messages: list[dict[str, str]] = CHAT,
    grammar: str | None = None,
    count_prompt: bool = False,
) -> list[int]:
    """Greedy (or seeded) decoding with the model called directly, one token at a time, the
    penalties applied by hand to each step's logits from a plain dict of counts of the tokens
    generated (`count_prompt`: of the prompt's too, the wrong semantics, as a control)."""
    from mlx_lm.models.cache import make_prompt_cache

    prompt = encode_chat(tokenizer, messages)
    cache = make_prompt_cache(model)
    sampler = make_sampler(temperature, top_p, seed)
    constraint = None
    if grammar is not None:
        constraint = Constraint(ll_tokenizer("reference", model, tokenizer), grammar)
    counts: dict[int, int] = {}
    if count_prompt:
        for token in prompt:
            counts[token] = counts.get(token, 0) + 1
    eos = set(tokenizer.eos_token_ids)
    out: list[int] = []
    inputs = list(prompt)
    for _ in range(max_tokens):
        logits = model(mx.array(inputs)[None], cache=cache)[:, -1, :]
        row = np.array(logits[0].astype(mx.float32))
        for token, count in counts.items():
            row[token] -= np.float32(frequency_penalty * count + presence_penalty * (count > 0))
        logits = mx.array(row)[None].astype(logits.dtype)
        if constraint is not None:
            logits = constraint(mx.array(prompt + out, dtype=mx.int32), logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        token = int(sampler(logprobs).item())
        if token in eos:
            break
        out.append(token)
        counts[token] = counts.get(token, 0) + 1
        inputs = [token]
    return out


# --- in this process: the formula ---------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_the_engine_applies_openais_formula_to_the_generated_tokens(tiny, case: str) -> None:
    model, tok = tiny
    penalties = CASES[case]
    got = run_one(model, tok, job(case, max_tokens=LONG, **penalties))
    assert got.end is not None and got.end.error is None
    expected = reference(model, tok, max_tokens=LONG, **penalties)
    assert got.tokens == expected
    # The control: counting the prompt too would have given other tokens (so the equality
    # above says the prompt is left out).
    if case in ("presence", "both-signs"):
        assert got.tokens != reference(model, tok, max_tokens=LONG, count_prompt=True, **penalties)


def test_a_frequency_penalty_breaks_the_loop_greedy_decoding_falls_into(tiny) -> None:
    model, tok = tiny
    plain = run_one(model, tok, job("plain", max_tokens=LONG)).tokens
    penalized = run_one(model, tok, job("penalized", max_tokens=LONG, frequency_penalty=2.0))
    assert penalized.tokens != plain
    n = min(len(plain), len(penalized.tokens))
    assert repeats(plain[:n]) > 5, "the test model no longer loops; pick another prompt"
    assert repeats(penalized.tokens[:n]) < repeats(plain[:n])
    # A negative penalty makes repeats likelier.
    attracted = run_one(model, tok, job("attracted", max_tokens=LONG, frequency_penalty=-2.0))
    n = min(len(plain), len(attracted.tokens))
    assert repeats(attracted.tokens[:n]) > repeats(plain[:n])
    # Zero is no penalty at all.
    zero = job("zero", max_tokens=LONG, presence_penalty=0.0, frequency_penalty=0.0)
    assert run_one(model, tok, zero).tokens == plain


WORDS = ["red", "green", "blue", "café"]
SCHEMA = {
    "type": "object",
    "properties": {
        "words": {
            "type": "array",
            "items": {"type": "string", "enum": WORDS},
            "minItems": 4,
            "maxItems": 6,
        }
    },
    "required": ["words"],
    "additionalProperties": False,
}


def json_grammar() -> str:
    grammar = build_grammar(ResponseFormat("json_schema", SCHEMA, strict=True), None)
    assert grammar is not None
    return grammar


def test_grammar_masks_and_penalty_shifts_together(tiny) -> None:
    model, tok = tiny
    grammar = json_grammar()
    penalties = {"presence_penalty": 0.5, "frequency_penalty": 1.5}
    got = run_one(model, tok, job("json", max_tokens=LONG, **penalties), grammar)
    assert got.finish_reason == "stop", got.end
    # Valid under the grammar, and the penalty steers the free choices: four different words
    # where the unpenalized run repeats some.
    words = json.loads(got.text)["words"]
    assert sorted(words) == sorted(WORDS), words
    plain = json.loads(run_one(model, tok, job("plain", max_tokens=LONG), grammar).text)["words"]
    assert len(set(plain)) < len(plain), "the unpenalized run no longer repeats; change the test"
    assert got.tokens == reference(model, tok, max_tokens=LONG, grammar=grammar, **penalties)


# --- in this process: batched = alone -------------------------------------------------------


def test_rows_with_different_penalties_in_one_batch_match_each_run_alone(tiny) -> None:
    model, tok = tiny
    jobs = {
        "none": {},
        "frequency": {"frequency_penalty": 2.0},
        "mixed-seeded": {"presence_penalty": 1.5, "frequency_penalty": -0.5, **SEEDED},
        "seeded": dict(SEEDED),
        "negative": {"frequency_penalty": -1.0},
        # Grammar rows: one with penalties, one that speculates under its grammar.
        "json": {"presence_penalty": 0.5, "frequency_penalty": 1.5},
        "json-plain": {},
    }
    grammars: dict[str, str | None] = {"json": json_grammar(), "json-plain": json_grammar()}

    def make(name: str) -> Any:
        return job(name, max_tokens=LONG, **jobs[name])

    alone = {
        name: run(model, tok, [make(name)], grammars.get(name), sched=scheduler(speculation=OFF))
        for name in jobs
    }
    sched = scheduler(speculation=FORCED, max_batch_size=len(jobs))
    together = run(model, tok, [make(name) for name in jobs], grammars, sched=sched)
    for name in jobs:
        got: Result = together[(name, 0)]
        assert got.end is not None and got.end.error is None, name
        assert got.tokens == alone[name][(name, 0)].tokens, name
        assert got.text == alone[name][(name, 0)].text, name
        drafted = sum(u.drafted for u in got.updates)
        if jobs[name].get("presence_penalty") or jobs[name].get("frequency_penalty"):
            assert drafted == 0, f"{name}: a row with penalties speculated"
    # The unpenalized rows did speculate beside them.
    assert sched.speculation_stats().verify_steps > 0
    assert sum(u.drafted for u in together[("none", 0)].updates) > 0


def test_each_choice_counts_its_own_tokens(tiny) -> None:
    model, tok = tiny
    penalties = {"presence_penalty": 1.0, "frequency_penalty": 0.5, **SEEDED}
    both = run(model, tok, [job("n2", max_tokens=LONG, n=2, **penalties)])
    first = reference(model, tok, max_tokens=LONG, **penalties)
    assert both[("n2", 0)].tokens == first
    assert both[("n2", 1)].tokens != first


# --- the worker process: resume, validation -------------------------------------------------


@pytest.fixture(scope="module")
def engine(test_model_dir: Path) -> Iterator[Engine]:
    eng = start_engine(test_model_dir)
    yield eng
    eng.client.stop()


@pytest.mark.parametrize(
    "penalties",
    [{"frequency_penalty": 2.0, "presence_penalty": 0.5}, {"frequency_penalty": 1.0, **SEEDED}],
    ids=["greedy", "seeded"],
)
def test_a_resumed_job_continues_exactly_as_the_uninterrupted_run(
    engine: Engine, tokenizer, penalties: dict[str, Any]
) -> None:
    full = engine.run(new_id(), max_tokens=LONG, **penalties)
    assert isinstance(full.end, JobFinished), full.end
    n = len(full.tokens)
    # Where the penalty first changed a token: resuming after it needs the resumed tokens
    # counted (they are re-prefilled as context, but were generated).
    plain = engine.run(
        new_id(),
        max_tokens=LONG,
        **{**penalties, "frequency_penalty": 0.0, "presence_penalty": 0.0},
    )
    diverged = next(
        (i for i, (a, b) in enumerate(zip(full.tokens, plain.tokens, strict=False)) if a != b),
        min(n, len(plain.tokens)),
    )
    assert 0 < diverged < n - 2, (diverged, n)
    for k in sorted({1, 7, diverged, diverged + 1, (diverged + n) // 2, n - 1}):
        resume_text = streamed_text(tokenizer, full.tokens[:k])
        resumed = engine.run(
            new_id(),
            max_tokens=LONG,
            resume_token_ids=full.tokens[:k],
            resume_text=resume_text,
            **penalties,
        )
        assert isinstance(resumed.end, JobFinished), (k, resumed.end)
        assert full.tokens[:k] + resumed.tokens == full.tokens, k
        assert resume_text + resumed.text == full.text, k
        assert resumed.end.finish_reason == full.end.finish_reason


@pytest.mark.parametrize("value", [2.5, -2.01, float("nan")])
def test_the_worker_refuses_penalties_out_of_range(engine: Engine, value: float) -> None:
    failed = engine.run(new_id(), presence_penalty=value).end
    assert isinstance(failed, JobFailed) and failed.code == "invalid_request", failed
    assert "presence_penalty" in failed.message


def test_task_params_carry_the_penalties() -> None:
    params = TaskParams(
        max_tokens=8, temperature=0, top_p=1, seed=1, presence_penalty=0.5, frequency_penalty=-1
    )
    loaded = TaskParams.load(params.dump())
    assert (loaded.presence_penalty, loaded.frequency_penalty) == (0.5, -1.0)
    # A row written before penalties were applied has neither: no penalties.
    old = TaskParams.load('{"max_tokens": 8, "temperature": 0, "top_p": 1, "seed": 1}')
    assert (old.presence_penalty, old.frequency_penalty) == (0.0, 0.0)


# --- a real server --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory, test_model_dir) -> Iterator[ServerProcess]:
    with sdk_server(tmp_path_factory.mktemp("penalties"), test_model_dir) as s:
        yield s


@pytest.fixture
def http(server) -> Iterator[httpx.Client]:
    with server.client() as c:
        yield c


def post(http: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = http.post(path, json={"model": MODEL, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_responses_apply_and_echo_the_penalties(http: httpx.Client) -> None:
    base = {"input": "Tell me about the café on the corner.", "temperature": 0}
    base["max_output_tokens"] = LONG
    plain = post(http, "/responses", base)
    assert plain["presence_penalty"] == 0 and plain["frequency_penalty"] == 0
    penalized = post(http, "/responses", {**base, "presence_penalty": 0.5, "frequency_penalty": 2})
    assert penalized["presence_penalty"] == 0.5 and penalized["frequency_penalty"] == 2
    assert penalized["output"][0]["content"][0]["text"] != plain["output"][0]["content"][0]["text"]
    again = http.get(f"/responses/{penalized['id']}").json()
    assert again["presence_penalty"] == 0.5 and again["frequency_penalty"] == 2
    # The same request again gives the same answer (greedy, penalties and all).
    repeat = post(http, "/responses", {**base, "presence_penalty": 0.5, "frequency_penalty": 2})
    assert repeat["output"][0]["content"][0]["text"] == again["output"][0]["content"][0]["text"]


def test_chat_completions_apply_the_penalties(http: httpx.Client) -> None:
    base = {
        "messages": [{"role": "user", "content": "Tell me about the café on the corner."}],
        "temperature": 0,
        "max_tokens": LONG,
    }
    plain = post(http, "/chat/completions", base)
    penalized = post(
        http, "/chat/completions", {**base, "frequency_penalty": 1.5, "presence_penalty": -0.5}
    )
    assert (
        penalized["choices"][0]["message"]["content"] != plain["choices"][0]["message"]["content"]
    )
    response = http.get(f"/responses/{penalized['response_id']}").json()
    assert response["frequency_penalty"] == 1.5 and response["presence_penalty"] == -0.5


@pytest.mark.parametrize("field", ["presence_penalty", "frequency_penalty"])
@pytest.mark.parametrize(
    ("value", "code"),
    [
        (2.5, "invalid_value"),
        (-2.5, "invalid_value"),
        ("x", "invalid_type"),
        (True, "invalid_type"),
    ],
)
@pytest.mark.parametrize("path", ["/responses", "/chat/completions"])
def test_out_of_range_or_not_a_number_is_a_400_naming_the_field(
    http: httpx.Client, path: str, field: str, value: Any, code: str
) -> None:
    body: dict[str, Any] = {"model": MODEL, field: value}
    if path == "/responses":
        body["input"] = "Hello"
    else:
        body["messages"] = [{"role": "user", "content": "Hello"}]
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["code"], error["param"]) == (code, field), error


def test_the_openapi_document_states_the_range(http: httpx.Client) -> None:
    schemas = http.get("/openapi.json").json()["components"]["schemas"]
    for request in ("CreateResponseRequest", "CreateChatCompletionRequest"):
        for field in ("presence_penalty", "frequency_penalty"):
            spec = schemas[request]["properties"][field]
            number = next(s for s in spec["anyOf"] if s.get("type") == "number")
            assert (number["minimum"], number["maximum"]) == (-2, 2), (request, field)
