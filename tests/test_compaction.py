"""`POST /responses/compact` (issue 36): the openai SDK's `responses.compact` against a real
server with the test model; the compacted conversation (its user messages and one sealed
`compaction` item) sent back as input continues exactly as the conversation the item stands
for; an altered or foreign item is a 400 naming it.

The test model has random weights: its summary is meaningless text, but it is the model's own,
sealed and opened again unchanged; what these tests check is the protocol and the round trip.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from sdkserver import MODEL, TOKEN, sdk_server
from serverproc import ServerProcess

from jupyter_lmsp.services.summaries import SUMMARY_PREFIX

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

GREEDY: dict[str, Any] = {"temperature": 0, "max_output_tokens": 24}
CONVERSATION: list[dict[str, Any]] = [
    {"role": "user", "content": "Find the weather in Oslo."},
    {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": '{"c":"Oslo"}'},
    {"type": "function_call_output", "call_id": "call_1", "output": "Rain, 4 degrees."},
    {"role": "assistant", "content": "It rains in Oslo, 4 degrees."},
    {"role": "user", "content": "And tomorrow?"},
]

SUMMARY_LIMIT = 24


@pytest.fixture(scope="module")
def server(tmp_path_factory, test_model_dir) -> Iterator[ServerProcess]:
    # A short summary limit (the test model rarely stops on its own): every compaction here
    # shows the trait holds, and stays quick.
    with sdk_server(
        tmp_path_factory.mktemp("compaction"),
        test_model_dir,
        compaction_summary_tokens=SUMMARY_LIMIT,
    ) as s:
        yield s


@pytest.fixture
def sdk(server) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.api, api_key=TOKEN, max_retries=0) as client:
        yield client


@pytest.fixture
def http(server) -> Iterator[httpx.Client]:
    with server.client() as c:
        yield c


def user_texts(output: list[Any]) -> list[str]:
    return [item.content[0].text for item in output if item.type == "message"]


def test_the_sdk_compacts_to_the_user_messages_and_one_sealed_item(sdk):
    compacted = sdk.responses.compact(model=MODEL, input=CONVERSATION)
    assert compacted.object == "response.compaction"
    assert user_texts(compacted.output) == ["Find the weather in Oslo.", "And tomorrow?"]
    assert [item.type for item in compacted.output] == ["message", "message", "compaction"]
    item = compacted.output[-1]
    assert item.id.startswith("cmp_") and item.encrypted_content.startswith("lmsp1.")
    # Nothing of the conversation shows through the seal.
    assert "Oslo" not in item.encrypted_content and "Rain" not in item.encrypted_content
    assert compacted.usage.input_tokens > 0
    assert 0 < compacted.usage.output_tokens <= SUMMARY_LIMIT
    assert compacted.usage.total_tokens == (
        compacted.usage.input_tokens + compacted.usage.output_tokens
    )


def test_the_compacted_conversation_continues_as_the_summary_it_seals(sdk, http):
    compacted = sdk.responses.compact(model=MODEL, input=CONVERSATION)
    # As the SDK parsed them (its output type reads the kept user messages' `input_text`
    # parts as output text, and warns when dumping them), sent back as they came.
    with pytest.warns(UserWarning, match="serializ"):
        items = [item.model_dump(exclude_none=True) for item in compacted.output]
    follow_up = {"role": "user", "content": "Will it snow?"}
    first = sdk.responses.create(model=MODEL, input=[*items, follow_up], **GREEDY)
    assert first.status in ("completed", "incomplete")
    # The item was opened into the summary message, in the place the item had.
    listed = http.get(f"/responses/{first.id}/input_items", params={"order": "asc"}).json()
    texts = [item["content"][0]["text"] for item in listed["data"]]
    assert texts[:2] == ["Find the weather in Oslo.", "And tomorrow?"]
    assert texts[2].startswith(SUMMARY_PREFIX) and len(texts[2]) > len(SUMMARY_PREFIX)
    assert texts[3] == "Will it snow?"
    # The same conversation written out in full gives the same greedy answer: the item
    # stands for exactly that message.
    spelled_out = [
        {"role": "user", "content": "Find the weather in Oslo."},
        {"role": "user", "content": "And tomorrow?"},
        {"role": "user", "content": texts[2]},
        follow_up,
    ]
    second = sdk.responses.create(model=MODEL, input=spelled_out, **GREEDY)
    assert second.output_text == first.output_text
    assert second.usage.input_tokens == first.usage.input_tokens
    # Compacting a conversation that holds a summary folds it into the new one.
    again = sdk.responses.compact(model=MODEL, input=[*items, follow_up])
    assert user_texts(again.output) == [*texts[:2], "Will it snow?"]


@pytest.mark.parametrize("how", ["altered", "foreign", "not sealed"])
def test_an_item_this_service_did_not_seal_is_a_400_naming_it(sdk, http, how):
    sealed = sdk.responses.compact(model=MODEL, input="Hello.").output[-1].encrypted_content
    blob = {
        "altered": sealed[:-6] + ("AAAAAA" if not sealed.endswith("AAAAAA") else "BBBBBB"),
        "foreign": "lmsp1." + "QUJD" * 20,
        "not sealed": "gAAAAABpM0Yj-opaque",
    }[how]
    body = {
        "model": MODEL,
        "input": [
            {"role": "user", "content": "Hi."},
            {"type": "compaction", "encrypted_content": blob},
        ],
    }
    for path in ("/responses", "/responses/compact"):
        r = http.post(path, json=body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == "invalid_encrypted_content"
        assert error["param"] == "input[1].encrypted_content"


def test_a_stored_response_compacts_with_the_turns_before_it(sdk):
    first = sdk.responses.create(model=MODEL, input="Name a colour.", **GREEDY)
    compacted = sdk.responses.compact(
        model=MODEL, previous_response_id=first.id, input="Name another."
    )
    assert user_texts(compacted.output) == ["Name a colour.", "Name another."]
    assert compacted.output[-1].type == "compaction"


def test_a_conversation_longer_than_the_window_still_compacts(sdk, http):
    # Far more than the test model's 4,096-token window: the summary sees the newest turns
    # that fit, and every user message is kept.
    long_turns = []
    for i in range(40):
        long_turns.append({"role": "user", "content": f"Question {i}: " + "tell me more " * 60})
        long_turns.append({"role": "assistant", "content": "Here is more. " * 60})
    r = http.post("/responses", json={"model": MODEL, "input": long_turns, **GREEDY})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    compacted = sdk.responses.compact(model=MODEL, input=long_turns)
    assert len(user_texts(compacted.output)) == 40
    assert compacted.usage.input_tokens < 4096


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        ({"model": MODEL}, "missing_required_parameter", "input"),
        ({"model": MODEL, "input": "Hi.", "service_tier": "scale"}, "unsupported_parameter", None),
        ({"model": MODEL, "input": "Hi.", "stream": True}, "unknown_parameter", "stream"),
        ({"model": MODEL, "previous_response_id": "resp_nope"}, "not_found", None),
    ],
)
def test_bad_compaction_requests_are_clear_errors(http, body, code, param):
    r = http.post("/responses/compact", json=body)
    assert 400 <= r.status_code < 500, r.text
    error = r.json()["error"]
    assert error["code"] == code, error
    if param is not None:
        assert error["param"] == param


# -- POST /responses/input_tokens --------------------------------------------------------------

TOOL = {
    "type": "function",
    "name": "weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


def test_the_count_is_the_prompt_a_response_is_given(sdk):
    cases: list[dict[str, Any]] = [
        {"input": "Hello there."},
        {"input": CONVERSATION, "instructions": "Answer briefly."},
        {"input": "Weather in Oslo?", "tools": [TOOL], "instructions": "Use tools."},
    ]
    for case in cases:
        counted = sdk.responses.input_tokens.count(model=MODEL, **case)
        assert counted.object == "response.input_tokens"
        ran = sdk.responses.create(model=MODEL, **case, **GREEDY)
        assert counted.input_tokens == ran.usage.input_tokens, case
    # The turns before previous_response_id count, and a compaction item counts as the
    # summary it seals.
    follow = sdk.responses.input_tokens.count(
        model=MODEL, previous_response_id=ran.id, input="And Paris?"
    )
    ran = sdk.responses.create(
        model=MODEL, previous_response_id=ran.id, input="And Paris?", tools=[TOOL], **GREEDY
    )
    assert follow.input_tokens < ran.usage.input_tokens  # this one renders the tool too
    assert (
        sdk.responses.input_tokens.count(
            model=MODEL, previous_response_id=ran.id, input="And Rome?", tools=[TOOL]
        ).input_tokens
        == sdk.responses.create(
            model=MODEL, previous_response_id=ran.id, input="And Rome?", tools=[TOOL], **GREEDY
        ).usage.input_tokens
    )
    compacted = sdk.responses.compact(model=MODEL, input=CONVERSATION)
    with pytest.warns(UserWarning, match="serializ"):
        items = [item.model_dump(exclude_none=True) for item in compacted.output]
    counted = sdk.responses.input_tokens.count(model=MODEL, input=items)
    assert (
        counted.input_tokens
        == sdk.responses.create(model=MODEL, input=items, **GREEDY).usage.input_tokens
    )


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"model": "no-such-model", "input": "Hi."}, 404, "model_not_found"),
        ({"model": MODEL, "input": "Hi.", "truncation": "auto"}, 400, "unsupported_parameter"),
        ({"model": MODEL, "input": "Hi.", "stream": True}, 400, "unknown_parameter"),
        ({"model": MODEL, "previous_response_id": "resp_nope"}, 404, "not_found"),
    ],
)
def test_bad_count_requests_are_clear_errors(http, body, status, code):
    r = http.post("/responses/input_tokens", json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code


def test_nothing_to_count_is_a_400_naming_input(http):
    r = http.post("/responses/input_tokens", json={"model": MODEL})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "missing_required_parameter"
    assert r.json()["error"]["param"] == "input"
    # Instructions alone are a prompt.
    r = http.post("/responses/input_tokens", json={"model": MODEL, "instructions": "Be brief."})
    assert r.status_code == 200 and r.json()["input_tokens"] > 0, r.text
