"""Fuzzing the served OpenAPI document with schemathesis against a real `jupyter server`
subprocess (the test model): for every documented operation, generated valid and invalid
requests must get no 5xx, no hang (a per-request timeout), answers that conform to the document
(status, content type, headers, body schema), and errors in the LMSP shape.

Bounded in time: few examples per operation, and generations are kept tiny — token limits
above MAX_TOKENS are lowered to it just before each call (a valid value stays valid), and the
server's default `max_output_tokens` and its compaction summary limit are small, so POSTs that
start generations do not queue long work on the serial worker (a compaction's summary of up
to 1,024 tokens made its positive cases half of the fuzz server's time).
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.config import SchemathesisConfig
from schemathesis.generation.meta import GenerationMode
from serverproc import TOKEN, ServerProcess, http_client, with_test_model

from jupyter_lmsp.handlers.pairing import PairingsHandler

# The whole run of every operation is one test: ~230 s in a full make test on 2 CPUs with the
# operations of issues 38 and 39 (it timed out at 240 s once).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MAX_TOKENS = 4
# A hang, not a slow answer: a streamed chat request with tools took over 20 s on a loaded
# machine (make test beside a CPU hog, load ~10).
REQUEST_TIMEOUT = 60.0
# A deeper run: LMSP_FUZZ_EXAMPLES=200 LMSP_FUZZ_SEED=7 pytest tests/test_fuzz_openapi.py
EXAMPLES = int(os.environ.get("LMSP_FUZZ_EXAMPLES", "12"))
SEED = int(os.environ.get("LMSP_FUZZ_SEED", "20261130"))
AUTH = {"Authorization": f"token {TOKEN}"}
# Request fields that set a generation's token limit.
TOKEN_LIMITS = ("max_output_tokens", "max_tokens", "max_completion_tokens")
ERROR_FIELDS = {"type", "code", "message", "param"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, test_model_dir: Path) -> Any:
    data = tmp_path_factory.mktemp("fuzz")
    with_test_model(data, test_model_dir)
    with ServerProcess(
        data,
        max_output_tokens_default=MAX_TOKENS,
        compaction_summary_tokens=MAX_TOKENS,
        keepalive_interval=1.0,
    ) as server:
        yield server


@schemathesis.hook
def before_call(context: Any, case: Any, kwargs: dict[str, Any]) -> None:
    """Lower token limits to MAX_TOKENS (schemathesis re-checks the case after this hook, and
    a lowered valid limit is still valid)."""
    if isinstance(case.body, dict):
        for name in TOKEN_LIMITS:
            value = case.body.get(name)
            if (
                isinstance(value, int | float)
                and not isinstance(value, bool)
                and value > MAX_TOKENS
            ):
                case.body[name] = MAX_TOKENS
        # The one rule the chat schema cannot state: both limits given must agree.
        if isinstance(case.body.get("max_tokens"), int) and "max_completion_tokens" in case.body:
            case.body["max_completion_tokens"] = case.body["max_tokens"]


def without_idempotency_keys(document: dict[str, Any]) -> dict[str, Any]:
    """The served document without `Idempotency-Key`: the short keys the generator favours
    collide across requests, so most POSTs would be answered as key mismatches (422) and
    never reach the parsers (tests/test_idempotency.py covers keys)."""
    for item in document["paths"].values():
        for name, op in item.items():
            if name.startswith("x-"):  # the WebSocket mode of /responses: no operation
                continue
            op["parameters"] = [
                p for p in op.get("parameters", []) if "IdempotencyKey" not in p.get("$ref", "")
            ]
    return document


# Streams that never end by themselves (the caller-wide lifecycle stream, followed until the
# client leaves): every valid call would run into the request timeout. Their validation is
# tested in tests/test_lifecycle.py; the hostile-value tests below still cover them.
ENDLESS = {"followLifecycle"}


def without_endless_streams(document: dict[str, Any]) -> dict[str, Any]:
    for path, item in list(document["paths"].items()):
        for method, op in list(item.items()):
            if op.get("operationId") in ENDLESS:
                del item[method]
        if not item:
            del document["paths"][path]
    return document


@pytest.fixture(scope="module")
def api_schema(server: ServerProcess) -> Any:
    document = httpx.get(f"{server.api}/openapi.json", timeout=30).json()
    config = SchemathesisConfig.from_dict(
        {
            "base-url": server.api,
            "request-timeout": REQUEST_TIMEOUT,
            "seed": SEED,
            "generation": {"mode": "all", "max-examples": EXAMPLES},
            "phases": {
                "examples": {"enabled": False},
                "coverage": {"enabled": True},
                "fuzzing": {"enabled": True},
                "stateful": {"enabled": False},
            },
            "checks": {
                "not_a_server_error": {"enabled": True},
                "status_code_conformance": {"enabled": True},
                "content_type_conformance": {"enabled": True},
                "response_headers_conformance": {"enabled": True},
                "response_schema_conformance": {"enabled": True},
                "negative_data_rejection": {"enabled": True},
                "ignored_auth": {"enabled": True},
                "unsupported_method": {"enabled": True},
                # Valid requests are accepted; ids and model names the generator makes up
                # are unknown (404), pairing is rate-limited (429).
                "positive_data_acceptance": {
                    "enabled": True,
                    "expected-statuses": ["2XX", 404, 409, 429],
                },
                "missing_required_header": {"enabled": False},
                "use_after_free": {"enabled": False},
                "ensure_resource_availability": {"enabled": False},
            },
            "operations": [
                *(
                    {
                        # Refusals a schema cannot state (test_fuzz checks the code).
                        "include-operation-id": operation,
                        "checks": {
                            "positive_data_acceptance": {
                                "expected-statuses": ["2XX", 400, 404, 409, 429]
                            }
                        },
                    }
                    for operation in (
                        "createResponse",
                        "createChatCompletion",
                        "compactResponse",
                        "countInputTokens",
                    )
                ),
                {
                    # Token ids beyond the model's vocabulary, inputs over its window,
                    # `dimensions` beyond its size or for a model not trained to be cut (400).
                    "include-operation-id": "createEmbeddings",
                    "checks": {
                        "positive_data_acceptance": {
                            "expected-statuses": ["2XX", 400, 404, 409, 429]
                        }
                    },
                },
                {
                    # The input items (`InputMessage`, `InputFunctionCall`, ... : one union, one
                    # parser) are the bulk of these bodies, and the coverage phase's boundary
                    # cases of that union (~580 of them) are the same wherever it appears: they
                    # run once, on `createResponse`. These operations keep the fuzzing phase
                    # (valid and invalid bodies, their own fields included), the hostile values
                    # below and their own tests. Run five times, the union's cases were half of
                    # this test's ~6,000 requests.
                    "include-operation-id": [
                        "compactResponse",
                        "countInputTokens",
                        "createConversation",
                        "createConversationItems",
                    ],
                    "phases": {"coverage": {"enabled": False}},
                },
                {
                    # A made-up source can name an existing folder that is not a model (400).
                    "include-operation-id": "registerModel",
                    "checks": {
                        "positive_data_acceptance": {"expected-statuses": ["2XX", 400, 404, 409]}
                    },
                },
            ],
        }
    )
    document = without_endless_streams(without_idempotency_keys(document))
    return schemathesis.openapi.from_dict(document, config=config)


schema = schemathesis.pytest.from_fixture("api_schema")


@pytest.fixture(autouse=True)
def _node_id_for_schemathesis(request: pytest.FixtureRequest) -> None:
    # schemathesis 4.32 reads `node._nodeid`, which pytest 9.2 no longer has (it keeps `_id`
    # behind `nodeid`); give it the string it expects.
    if not hasattr(request.node, "_nodeid"):
        request.node._nodeid = request.node.nodeid


@schema.parametrize()
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    database=None,
)
def test_fuzz(case: Any) -> None:
    started = time.monotonic()
    # Credentials passed explicitly: the ignored_auth check then also sends the request
    # without them, and with wrong ones, and wants a 401.
    response = case.call_and_validate(headers=AUTH, timeout=REQUEST_TIMEOUT)
    assert time.monotonic() - started < REQUEST_TIMEOUT
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        body = response.json()
        assert set(body) == {"error"}, body
        assert set(body["error"]) == ERROR_FIELDS, body
        assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    if response.status_code == 400 and case.meta.generation.mode == GenerationMode.POSITIVE:
        # A schema-valid body refused: only for what no JSON Schema can say.
        assert case.operation.label in GENERATIONS, body
        error = body["error"]
        assert (
            error["code"] in SEMANTIC_REFUSALS
            or error["param"] == "n"
            # A compaction needs `input` or `previous_response_id` (a count may do with
            # `instructions`): a rule across fields.
            or (
                case.operation.label in ("POST /responses/compact", "POST /responses/input_tokens")
                and error["code"] == "missing_required_parameter"
                and error["param"] == "input"
            )
            or (
                error["code"] == "invalid_value"
                and CROSS_FIELD_PARAMS.fullmatch(error["param"] or "") is not None
            )
            # What only the model can say: its vocabulary, window and vector size.
            or (
                case.operation.label == "POST /embeddings"
                and error["code"] == "invalid_value"
                and error["param"] in ("input", "dimensions")
            )
        ), body
        if body["error"]["code"] == "unsupported_parameter":
            # Log-probabilities beside function tools, or an effort the model cannot take
            # (which efforts a model takes is its template's, not the document's).
            assert "together with function tools" in body["error"]["message"] or body["error"][
                "param"
            ] in ("reasoning_effort", "reasoning.effort"), body


# -- hostile values the schema does not describe (issue 12, item 8) --------------------------

# What a schema-valid generation request may still be refused for: a prompt longer than the
# context window (counted with the model's tokenizer), a schema the grammar compiler cannot
# take (`invalid_schema`), log-probabilities asked for beside function tools, a reasoning
# effort the model cannot take, more chat
# choices than the configured maximum (`n`), a compaction item this service did not seal
# (`invalid_encrypted_content`), a prompt the model's template cannot render
# (`prompt_not_countable`).
GENERATIONS = {
    "POST /embeddings",
    "POST /responses",
    "POST /chat/completions",
    "POST /responses/compact",
    "POST /responses/input_tokens",
}
SEMANTIC_REFUSALS = {
    "context_length_exceeded",
    "invalid_schema",
    "unsupported_parameter",
    "invalid_encrypted_content",
    "prompt_not_countable",
}
# Rules across the tools of `POST /responses` the document cannot state
# (protocol/responses.py): function names unique once namespaces are flattened, and
# `allowed_tools` naming declared functions.
CROSS_FIELD_PARAMS = re.compile(r"tools|tool_choice\.tools\[\d+\]\.name")


# JSON texts that parsers choke on or disagree about: each must be a 400, never a 500.
DEEP_ARRAY = "[" * 50_000 + "]" * 50_000
DEEP_OBJECT = '{"a":' * 5_000 + "1" + "}" * 5_000
HUGE_INT = "9" * 5_000
LONE_SURROGATES = ['"\\ud800"', '"\\udfff"', '"x\\ud83dy"']
HUGE_QUERY_INTS = ["9" * 30, "-" + "9" * 30, "9" * 5_000, "1e400", "NaN"]

hostile_json = st.sampled_from(
    [DEEP_ARRAY, DEEP_OBJECT, HUGE_INT, "1e400", "NaN", "-Infinity", *LONE_SURROGATES]
)


def _operations(document: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    ops = []
    for path, item in document["paths"].items():
        for method, op in item.items():
            if not method.startswith("x-"):
                ops.append((method.upper(), path, op))
    return ops


@pytest.fixture(scope="module")
def real_ids(server: ServerProcess) -> dict[str, str]:
    """Ids of things that exist, so a hostile value reaches the code past the look-up."""
    with http_client(base_url=server.api, headers=AUTH, timeout=60) as c:
        r = c.post("/responses", json={"input": "x", "max_output_tokens": 2}).json()
    return {"response_id": r["id"], "task_id": r["task_id"], "model_id": "tiny"}


def _concrete(path: str, ids: dict[str, str]) -> str:
    return re.sub(r"\{(\w+)\}", lambda m: ids.get(m.group(1), "x_" + m.group(1)), path)


@pytest.fixture(scope="module")
def document(server: ServerProcess) -> dict[str, Any]:
    return httpx.get(f"{server.api}/openapi.json", timeout=30).json()


def _assert_lmsp_4xx(response: httpx.Response) -> None:
    assert response.status_code < 500, response.text[:300]
    if response.status_code >= 400:
        body = response.json()
        assert set(body) == {"error"} and set(body["error"]) == ERROR_FIELDS, body


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_hostile_bodies_are_refused_as_errors(server, document, real_ids, data):
    """A deep, huge or non-Unicode value put anywhere in a request body: a body of its own,
    or in place of a field the operation declares."""
    ops = [(m, p, op) for m, p, op in _operations(document) if "requestBody" in op]
    method, path, op = data.draw(st.sampled_from(ops))
    value = data.draw(hostile_json)
    schema = op["requestBody"]["content"]["application/json"]["schema"]
    name = schema["$ref"].rsplit("/", 1)[1]
    fields = list(document["components"]["schemas"][name].get("properties", {}))
    field = data.draw(st.sampled_from([None, *fields]))
    body = value if field is None else f'{{"{field}": {value}}}'
    with http_client(base_url=server.api, headers=AUTH, timeout=REQUEST_TIMEOUT) as c:
        response = c.request(
            method,
            _concrete(path, real_ids),
            content=body,
            headers={"Content-Type": "application/json"},
        )
    _assert_lmsp_4xx(response)
    if response.status_code == 413:
        # Only the unauthenticated pairing start caps bodies below these values' sizes
        # (a few KiB, read before parsing: issue 43); every other route takes them whole.
        assert (method, path) == ("POST", "/pairings"), (method, path)
        assert len(body) > PairingsHandler.body_limit, len(body)
        assert response.json()["error"]["code"] == "request_too_large", response.text
    else:
        assert response.status_code in (400, 404, 409, 429), response.text[:300]


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_hostile_query_values_are_refused_as_errors(server, document, real_ids, data):
    """Numbers beyond what the database stores, and not-numbers, in every query parameter
    and in `Last-Event-ID`."""
    ops = [
        (m, p, op)
        for m, p, op in _operations(document)
        if any(x.get("in") in ("query", "header") for x in op.get("parameters", []))
    ]
    method, path, op = data.draw(st.sampled_from(ops))
    params = [x for x in op["parameters"] if x.get("in") in ("query", "header")]
    param = data.draw(st.sampled_from(params))
    value = data.draw(st.sampled_from(HUGE_QUERY_INTS))
    kwargs: dict[str, Any] = (
        {"params": {param["name"]: value}}
        if param["in"] == "query"
        else {"headers": {**AUTH, param["name"]: value}}
    )
    with http_client(base_url=server.api, headers=AUTH, timeout=REQUEST_TIMEOUT) as c:
        response = c.request(method, _concrete(path, real_ids), **kwargs)
    _assert_lmsp_4xx(response)
