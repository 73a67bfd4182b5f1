"""Conversations (issue 38) through a real `jupyter server`: the openai SDK's
`client.conversations.*` calls unmodified (with the SDK's strict response validation), the
`conversation` parameter of `POST /responses`, per-caller ownership with a paired client, the
`openai-agents` SDK's `OpenAIConversationsSession` over three turns, and `truncation: "auto"`.

The model is tests/scriptedmodel.py: greedy decoding answers `ANSWER_TEXT` when its prompt
holds the `<tool_response>` token (`RESULT_MARKER`) anywhere, and `CALL_TEXT` otherwise (no
tools are offered here, so both are plain text). A first turn that says the marker is thus
remembered exactly when a later turn's prompt still holds it: the answer says which.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from scriptedmodel import ANSWER_TEXT, CALL_NAME, CALL_TEXT, RESULT_MARKER, make_scripted_model
from serverproc import TOKEN, ServerProcess, http_client

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MODEL = "scripted"
WINDOW = 768
GREEDY: dict[str, Any] = {"model": MODEL, "temperature": 0, "max_output_tokens": 8}
REMEMBER = f"The code word is {RESULT_MARKER}."


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("conversations")
    make_scripted_model(root / "models" / MODEL)
    with ServerProcess(root, default_model=MODEL, max_context_tokens=WINDOW).start() as s:
        yield s


@pytest.fixture
def sdk(server) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=server.api, api_key=TOKEN, max_retries=0, _strict_response_validation=True
    ) as client:
        yield client


@pytest.fixture
def http(server) -> Iterator[httpx.Client]:
    with server.client() as c:
        yield c


def texts(items: Any) -> list[str]:
    return [part.text for item in items for part in item.content]


def test_the_sdk_conversation_calls(sdk):
    conv = sdk.conversations.create(
        items=[{"role": "user", "content": "one"}, {"role": "assistant", "content": "two"}],
        metadata={"topic": "numbers"},
    )
    assert conv.id.startswith("conv_") and conv.metadata == {"topic": "numbers"}
    assert sdk.conversations.retrieve(conv.id) == conv
    updated = sdk.conversations.update(conv.id, metadata={"topic": "counting"})
    assert updated.metadata == {"topic": "counting"}

    added = sdk.conversations.items.create(
        conv.id,
        items=[
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "3"}]},
            {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "4"},
            {"role": "user", "content": "five"},
        ],
    )
    assert [i.type for i in added.data] == [
        "message",
        "function_call",
        "function_call_output",
        "message",
    ]
    assert not added.has_more and added.first_id == added.data[0].id

    # Auto-pagination, two items a page, both orders.
    ascending = list(sdk.conversations.items.list(conv.id, order="asc", limit=2))
    assert [i.type for i in ascending][:2] == ["message", "message"]
    assert len(ascending) == 6 and ascending[2].id == added.data[0].id
    assert texts(ascending[:2]) == ["one", "two"] and ascending[1].role == "assistant"
    descending = list(sdk.conversations.items.list(conv.id, limit=4))
    assert [i.id for i in descending] == [i.id for i in reversed(ascending)]
    page = sdk.conversations.items.list(conv.id, after=ascending[3].id, order="asc", limit=1)
    assert [i.id for i in page.data] == [ascending[4].id] and page.has_more

    call = sdk.conversations.items.retrieve(ascending[3].id, conversation_id=conv.id)
    assert call.type == "function_call" and call.call_id == "call_1"
    assert sdk.conversations.items.delete(ascending[3].id, conversation_id=conv.id).id == conv.id
    with pytest.raises(openai.NotFoundError):
        sdk.conversations.items.retrieve(ascending[3].id, conversation_id=conv.id)
    assert len(list(sdk.conversations.items.list(conv.id, limit=100))) == 5

    deleted = sdk.conversations.delete(conv.id)
    assert deleted.deleted and deleted.id == conv.id
    with pytest.raises(openai.NotFoundError):
        sdk.conversations.retrieve(conv.id)
    with pytest.raises(openai.NotFoundError):
        sdk.conversations.items.list(conv.id)


@pytest.mark.parametrize(
    ("path", "body", "code", "param"),
    [
        (
            "/conversations",
            {"items": [{"role": "user", "content": "x"}] * 21},
            "invalid_value",
            "items",
        ),
        (
            "/conversations",
            {"items": [{"type": "web_search_call"}]},
            "unsupported_input",
            "items[0]",
        ),
        ("/conversations", {"metadata": {"k": 1}}, "invalid_value", "metadata"),
        ("/conversations", {"colour": 1}, "unknown_parameter", "colour"),
        (
            "/responses",
            {"input": "x", "conversation": {"idx": "c"}},
            "invalid_value",
            "conversation.id",
        ),
        (
            "/responses",
            {"input": "x", "conversation": "conv_1", "previous_response_id": "resp_1"},
            "mutually_exclusive_parameters",
            "conversation",
        ),
        ("/responses", {"input": "x", "truncation": "middle"}, "invalid_value", "truncation"),
    ],
)
def test_bad_requests_are_clear_400s(http, path, body, code, param):
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    assert (r.json()["error"]["code"], r.json()["error"]["param"]) == (code, param)


def test_a_response_in_a_conversation_is_given_its_items_and_adds_its_turn(sdk, http):
    conv = sdk.conversations.create(items=[{"role": "user", "content": REMEMBER}])
    # Without the conversation, the same input has no code word to remember.
    assert sdk.responses.create(input="What was it?", **GREEDY).output_text == CALL_TEXT
    first = sdk.responses.create(input="What was it?", conversation=conv.id, **GREEDY)
    assert first.output_text == ANSWER_TEXT and first.conversation.id == conv.id
    second = sdk.responses.create(input="Again?", conversation={"id": conv.id}, **GREEDY)
    assert second.output_text == ANSWER_TEXT
    items = list(sdk.conversations.items.list(conv.id, order="asc"))
    assert texts(items) == [REMEMBER, "What was it?", ANSWER_TEXT, "Again?", ANSWER_TEXT]
    assert items[2].id == first.output[0].id and items[4].id == second.output[0].id
    # The response's input items are the same items the conversation holds.
    assert [i.id for i in sdk.responses.input_items.list(second.id)] == [items[3].id]

    missing = http.post("/responses", json={"input": "x", "conversation": "conv_nope"})
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "conversation"
    with pytest.raises(openai.BadRequestError):
        sdk.responses.create(input="x", conversation=conv.id, previous_response_id=first.id)


def test_a_tool_round_trip_through_a_conversation(sdk):
    tools = [
        {
            "type": "function",
            "name": CALL_NAME,
            "parameters": {
                "type": "object",
                "properties": {"cmd": {"type": "string"}},
                "required": ["cmd"],
            },
        }
    ]
    conv = sdk.conversations.create()
    called = sdk.responses.create(
        model=MODEL, input="Run it.", conversation=conv.id, tools=tools, temperature=0
    )
    (call,) = called.output
    assert call.type == "function_call" and call.name == CALL_NAME
    # Only the call's output is sent: the call itself comes from the conversation.
    answered = sdk.responses.create(
        model=MODEL,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "hi"}],
        conversation=conv.id,
        tools=tools,
        temperature=0,
    )
    assert answered.output_text == ANSWER_TEXT
    # Custom tool items (listed with a status) are read back as history too.
    sdk.responses.create(
        input=[
            {"type": "custom_tool_call", "call_id": "c9", "name": "x", "input": "abc"},
            {"type": "custom_tool_call_output", "call_id": "c9", "output": "ok"},
            {"role": "user", "content": "go"},
        ],
        conversation=conv.id,
        **GREEDY,
    )
    assert sdk.responses.create(input="Again.", conversation=conv.id, **GREEDY).status == (
        "completed"
    )
    kinds = [i.type for i in sdk.conversations.items.list(conv.id, order="asc", limit=100)]
    assert kinds[:4] == ["message", "function_call", "function_call_output", "message"]
    assert kinds[4:6] == ["custom_tool_call", "custom_tool_call_output"]
    assert len(kinds) == 10


def _pair(http: httpx.Client, server: ServerProcess, scopes: list[str]) -> openai.OpenAI:
    with http_client(base_url=server.api, timeout=30) as anonymous:
        started = anonymous.post("/pairings", json={"client_name": "conv", "scopes": scopes})
        pairing = started.json()
        assert http.post(f"/pairings/{pairing['id']}/approve", json={}).status_code == 200
        token = anonymous.post(
            f"/pairings/{pairing['id']}/token", json={"device_code": pairing["device_code"]}
        ).json()
    return openai.OpenAI(base_url=server.api, api_key=token["access_token"], max_retries=0)


def test_a_paired_client_owns_its_conversations(sdk, http, server):
    scopes = ["responses:read", "responses:write", "conversations:read", "conversations:write"]
    with (
        _pair(http, server, scopes) as client,
        _pair(http, server, ["responses:write", "conversations:read"]) as reader,
    ):
        mine = client.conversations.create(items=[{"role": "user", "content": REMEMBER}])
        owners = sdk.conversations.create()
        for call in (
            lambda: client.conversations.retrieve(owners.id),
            lambda: client.conversations.items.list(owners.id),
            lambda: client.conversations.delete(owners.id),
            lambda: client.responses.create(input="x", conversation=owners.id, **GREEDY),
            lambda: reader.conversations.retrieve(mine.id),
        ):
            with pytest.raises(openai.NotFoundError):
                call()
        # The owner (the Jupyter user) sees the conversations of the clients it paired.
        assert sdk.conversations.retrieve(mine.id).id == mine.id
        answer = client.responses.create(input="And?", conversation=mine.id, **GREEDY)
        assert answer.output_text == ANSWER_TEXT
        # Writing a turn into a conversation needs `conversations:write`.
        with pytest.raises(openai.PermissionDeniedError):
            reader.conversations.create()
        with pytest.raises(openai.PermissionDeniedError):
            reader.responses.create(input="x", conversation=mine.id, **GREEDY)


def test_openai_agents_conversations_session_remembers_the_first_turn(server):
    from agents import Agent, OpenAIResponsesModel, Runner, set_tracing_disabled
    from agents.memory import OpenAIConversationsSession

    set_tracing_disabled(True)

    async def run() -> None:
        client = openai.AsyncOpenAI(base_url=server.api, api_key=TOKEN, max_retries=0)
        agent = Agent(
            name="scripted",
            instructions="Answer briefly.",
            model=OpenAIResponsesModel(model=MODEL, openai_client=client),
        )
        session = OpenAIConversationsSession(openai_client=client)
        answers = []
        for prompt in (REMEMBER, "Tell me something else.", "What was the code word?"):
            result = await Runner.run(agent, prompt, session=session)
            answers.append(result.final_output)
        # The third turn's prompt held the first turn's code word, through the session only.
        assert answers == [ANSWER_TEXT] * 3
        items = await session.get_items()
        assert [i["role"] for i in items] == ["user", "assistant"] * 3
        fresh = OpenAIConversationsSession(openai_client=client)
        alone = await Runner.run(agent, "What was the code word?", session=fresh)
        assert alone.final_output == CALL_TEXT

        # The server keeps the history itself: `conversation_id` sends only each new turn.
        conversation = await client.conversations.create()
        answers = []
        for prompt in (REMEMBER, "Tell me something else.", "What was the code word?"):
            result = await Runner.run(agent, prompt, conversation_id=conversation.id)
            answers.append(result.final_output)
        assert answers == [ANSWER_TEXT] * 3
        listed = [i async for i in client.conversations.items.list(conversation.id)]
        assert len(listed) == 6
        await client.close()

    asyncio.run(run())


def test_truncation_auto_drops_the_oldest_turns_and_says_so(sdk, http):
    # The code word in the first turn, then enough turns for twice the window.
    filler = "Here is some more text for the window to hold. " * 4
    items: list[dict[str, Any]] = [
        {"role": "user", "content": REMEMBER},
        {"role": "assistant", "content": "Noted."},
    ]
    while True:
        count = http.post("/responses/input_tokens", json={"model": MODEL, "input": items}).json()[
            "input_tokens"
        ]
        if count >= 2 * WINDOW:
            break
        items += [{"role": "user", "content": filler}, {"role": "assistant", "content": "Yes."}]
    items.append({"role": "user", "content": "What was the code word?"})

    refused = http.post("/responses", json={"input": items, **GREEDY})
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "context_length_exceeded"

    response = sdk.responses.create(input=items, truncation="auto", **GREEDY)
    assert response.status == "completed" and response.truncation == "auto"
    details = response.model_extra["truncation_details"]
    assert details["type"] == "auto" and details["input_tokens_before"] >= 2 * WINDOW
    assert 0 < details["dropped_messages"] < len(items)
    assert response.usage.input_tokens < WINDOW
    # The first turn went: the code word is no longer in the prompt, and the answer says so.
    assert response.output_text == CALL_TEXT
    kept = list(sdk.responses.input_items.list(response.id, order="asc", limit=100))
    assert len(kept) == len(items) - details["dropped_messages"]
    assert texts(kept)[-1] == "What was the code word?"

    # A conversation too long for the window: its oldest items go the same way.
    conv = sdk.conversations.create()
    for start in range(0, len(items) - 1, 20):
        sdk.conversations.items.create(
            conv.id, items=items[start : min(start + 20, len(items) - 1)]
        )
    answer = sdk.responses.create(
        input="What was the code word?", conversation=conv.id, truncation="auto", **GREEDY
    )
    assert answer.status == "completed" and answer.output_text == CALL_TEXT
    assert answer.model_extra["truncation_details"]["dropped_messages"] > 0
