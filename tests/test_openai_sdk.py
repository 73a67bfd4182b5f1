"""The official `openai` Python SDK, unmodified apart from `base_url` and `api_key`, against a real
`jupyter server` running the extension (LMSP B5, B6, B8, B10).

It proves that every call a Responses API user makes — `responses.create` (plain, streamed,
background), `responses.stream` (new and resumed), `responses.retrieve` (plain and streamed from
a sequence number), `cancel`, `delete`, `input_items.list` with auto-paging, sampling and
context parameters, `chat.completions.create` — works and returns what the SDK expects, and
that errors arrive as the SDK's typed exceptions.

Every SDK test runs twice: with the SDK's default (lenient) parsing and with
`_strict_response_validation=True`; the OpenAI-shaped streams carry only types the SDK knows, so
both pass (docs/protocol.md, "openai SDK strict validation").
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from sdkserver import MODEL, TOKEN, sdk_server
from serverproc import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

TERMINAL_EVENTS = {
    "response.completed",
    "response.incomplete",
    "response.failed",
    "response.cancelled",
}
FINISHED = {"completed", "incomplete", "failed", "cancelled"}
SHORT = 12
# Greedy decoding of this prompt reaches end-of-sequence after ~90 tokens with the test model,
# so it ends `completed` (which `get_final_response()` requires) in well under a second.
COMPLETES: dict[str, Any] = {"input": "Hello", "temperature": 0, "max_output_tokens": 256}
# Greedy and short: deterministic text, never empty. (Sampled text from the random-weight test
# model can be empty: end-of-sequence may come first.)
HELLO: dict[str, Any] = {"input": "Hello there", "temperature": 0, "max_output_tokens": SHORT}
# Greedy decoding of this prompt runs for hundreds of tokens without end-of-sequence.
LONG_PROMPT = "Tell me a story."

# -- fixtures -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory, test_model_dir) -> Iterator[ServerProcess]:
    """The module's server: tiny model, full speed."""
    with sdk_server(tmp_path_factory.mktemp("sdk"), test_model_dir) as s:
        yield s


@pytest.fixture(scope="module")
def slow_server(tmp_path_factory, test_model_dir) -> Iterator[ServerProcess]:
    """A second server whose worker waits 20 ms per token, so a generation is still running
    when a test cancels it or sends a second request beside it. Started only when used."""
    with sdk_server(
        tmp_path_factory.mktemp("sdk-slow"), test_model_dir, engine_token_delay=0.02
    ) as s:
        yield s


@pytest.fixture(params=[False, True], ids=["lenient", "strict"])
def strict(request) -> bool:
    return request.param


def make_client(
    server: ServerProcess, strict: bool, api_key: str = TOKEN, **kw: Any
) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=server.api, api_key=api_key, _strict_response_validation=strict, **kw
    )


@pytest.fixture
def client(server, strict) -> Iterator[openai.OpenAI]:
    with make_client(server, strict) as c:
        yield c


@pytest.fixture
def slow_client(slow_server, strict) -> Iterator[openai.OpenAI]:
    with make_client(slow_server, strict) as c:
        yield c


# -- helpers --------------------------------------------------------------------------------


def wait_finished(client: openai.OpenAI, response_id: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = client.responses.retrieve(response_id)
        if r.status in FINISHED:
            return r
        time.sleep(0.05)
    raise AssertionError(f"{response_id} did not finish: {r.status}")


def raw_events(server: ServerProcess, task_id: str) -> list[dict[str, Any]]:
    """The task's whole event log as stored (LMSP's own JSON page, not the SDK)."""
    with server.client() as c:
        page = c.get(f"/tasks/{task_id}/events", params={"limit": 1000}).json()
    assert not page["has_more"]
    return page["data"]


def extra(obj: Any, name: str) -> Any:
    """An LMSP field the SDK's model does not declare (kept as an extra)."""
    return (obj.model_extra or {})[name]


def check_event_order(events: list[Any], start: int = 0) -> None:
    """Sequence numbers contiguous from `start`; item → part → delta → done; one terminal.

    A stream resumed after `start - 1` may lack the first of these events; the rest must still
    come in this order."""
    assert [e.sequence_number for e in events] == list(range(start, start + len(events)))
    types = [e.type for e in events]
    assert sum(t in TERMINAL_EVENTS for t in types) == 1
    assert types[-1] in TERMINAL_EVENTS
    order = [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    ranks = [order.index(t) for t in types if t in order]
    assert ranks == sorted(ranks), types
    assert ranks[-1] == len(order) - 1 and order.index("response.output_text.delta") in ranks
    if start == 0:
        assert types[0] == "response.created"
        assert ranks[0] == 0
    item_ids = {e.item_id for e in events if getattr(e, "item_id", None)}
    assert len(item_ids) == 1


def response_id_of(event: Any) -> str:
    """The response id a lifecycle event carries (a plain dict where the SDK left one)."""
    response = event.response
    return response["id"] if isinstance(response, dict) else response.id


# -- authentication -------------------------------------------------------------------------


def test_bearer_scheme_is_accepted(server):
    """The SDK sends `Authorization: Bearer <api_key>`; Jupyter's token scheme works as well."""
    for scheme in ("Bearer", "token", "bearer"):
        r = httpx.get(f"{server.api}/service", headers={"Authorization": f"{scheme} {TOKEN}"})
        assert r.status_code == 200, (scheme, r.text)
    r = httpx.get(f"{server.api}/service", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    assert r.headers["WWW-Authenticate"].startswith("Bearer")


def test_authentication_error(server, strict):
    with (
        make_client(server, strict, api_key="wrong") as bad,
        pytest.raises(openai.AuthenticationError) as e,
    ):
        bad.responses.create(model=MODEL, input="Hello", max_output_tokens=SHORT)
    assert e.value.status_code == 401
    assert e.value.type == "authentication_error"


# -- responses.create -----------------------------------------------------------------------


def test_create_plain(client):
    r = client.responses.create(model=MODEL, **HELLO)
    assert r.object == "response"
    assert r.id.startswith("resp_")
    assert r.model == MODEL
    assert r.status in ("completed", "incomplete")
    assert r.output_text
    [message] = r.output
    assert message.type == "message" and message.role == "assistant"
    assert r.usage is not None
    assert r.usage.input_tokens > 0
    assert 0 < r.usage.output_tokens <= SHORT
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    # Earlier tests may have left this prompt in the prompt cache: all of it but the last token.
    assert 0 <= r.usage.input_tokens_details.cached_tokens < r.usage.input_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.background is False
    assert client.responses.retrieve(r.id).output_text == r.output_text


def test_create_plain_completed(client):
    r = client.responses.create(model=MODEL, **COMPLETES)
    assert r.status == "completed"
    assert r.incomplete_details is None
    assert r.output_text
    assert r.output[0].status == "completed"


def test_create_stream(client):
    events = list(client.responses.create(model=MODEL, stream=True, **COMPLETES))
    check_event_order(events)
    lifecycle = [e for e in events if getattr(e, "response", None) is not None]
    assert len(lifecycle) >= 3  # created, queued, in_progress, completed
    assert len({response_id_of(e) for e in lifecycle}) == 1
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    assert text and done.text == text
    final = events[-1]
    assert final.type == "response.completed"
    assert final.response.status == "completed"
    assert final.response.output_text == text
    assert final.response.usage.output_tokens > 0
    assert client.responses.retrieve(final.response.id).output_text == text


def test_create_background(client):
    raw = client.responses.with_raw_response.create(model=MODEL, background=True, **HELLO)
    assert raw.status_code == 202
    r = raw.parse()
    assert raw.headers["Location"].endswith(f"/lmsp/v1/responses/{r.id}")
    assert r.status in ("queued", "in_progress")
    assert r.background is True
    done = wait_finished(client, r.id)
    assert done.id == r.id
    assert done.status in ("completed", "incomplete")
    assert done.output_text
    assert done.usage.output_tokens <= SHORT


# -- background and streamed at once (the SDK's background-streaming examples) ---------------


def _first_events(stream: Any, deltas: int) -> list[Any]:
    """Read `stream` until `deltas` text deltas arrived; leaving the `with` block that holds it
    then drops the connection midway."""
    seen = []
    for event in stream:
        seen.append(event)
        if sum(e.type == "response.output_text.delta" for e in seen) >= deltas:
            break
    return seen


LONG_BACKGROUND: dict[str, Any] = {
    "input": LONG_PROMPT,
    "temperature": 0,
    "max_output_tokens": 60,
    "background": True,
}


def test_background_stream_dropped_and_resumed_gets_every_event_once(slow_client):
    """`responses.create(background=True, stream=True)`: events from sequence 0, the task
    survives the client leaving midway, and `retrieve(stream=True, starting_after=N)` gives
    the rest, each event exactly once."""
    with slow_client.responses.create(model=MODEL, stream=True, **LONG_BACKGROUND) as stream:
        first = _first_events(stream, deltas=3)
    assert first[0].type == "response.created" and first[0].sequence_number == 0
    response_id = response_id_of(first[0])
    # The client is gone; the background task is not.
    assert slow_client.responses.retrieve(response_id).status in ("queued", "in_progress")
    cursor = first[-1].sequence_number
    with slow_client.responses.retrieve(response_id, stream=True, starting_after=cursor) as stream:
        rest = list(stream)
    events = first + rest
    check_event_order(events)
    final = wait_finished(slow_client, response_id)
    assert final.background is True and extra(final, "on_restart") == "resume"
    assert final.status == "incomplete"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text


def test_stream_helper_background_dropped_and_resumed(slow_client):
    """`responses.stream(..., background=True)`, left midway, then
    `responses.stream(response_id=…, starting_after=N)`: the helper's final response is the
    task's."""
    # `get_final_response()` wants `response.completed`: a prompt the model ends by itself.
    with slow_client.responses.stream(model=MODEL, background=True, **COMPLETES) as stream:
        first = _first_events(stream, deltas=2)
    response_id = response_id_of(first[0])
    cursor = first[-1].sequence_number
    with slow_client.responses.stream(response_id=response_id, starting_after=cursor) as stream:
        rest = list(stream)
        final = stream.get_final_response()
    check_event_order(first + rest)
    assert final.id == response_id and final.status == "completed"
    assert final.output_text == wait_finished(slow_client, response_id).output_text


def test_fields_clients_send_routinely_are_accepted(client):
    """What the Agents SDK, pydantic-ai, LangChain and others set on every request: labels,
    hints, and neutral values of features this service does not have."""
    r = client.responses.create(
        model=MODEL,
        input="Hello there",
        max_output_tokens=SHORT,
        user="someone",
        safety_identifier="user-1234",
        prompt_cache_key="conversation-1",
        service_tier="auto",
        top_logprobs=0,
        text={"format": {"type": "text"}, "verbosity": "medium"},
        max_tool_calls=None,
        conversation=None,
        parallel_tool_calls=True,
        tool_choice="auto",
        tools=[],
        truncation="disabled",
        include=[],
        reasoning=None,
        store=True,
    )
    assert r.status in ("completed", "incomplete")


def test_unsupported_fields_name_the_most_significant(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(
            model=MODEL,
            input="Hello",
            tools=[{"type": "web_search"}],
            text={"verbosity": "low"},
        )
    assert e.value.code == "unsupported_parameter" and e.value.param == "tools[0]"
    assert "only function and custom tools" in e.value.message
    for kwargs, param in (
        ({"text": {"verbosity": "low"}}, "text.verbosity"),
        ({"include": ["file_search_call.results"]}, "include[0]"),
        ({"prompt": {"id": "pmpt_123"}}, "prompt"),
        ({"service_tier": "scale"}, "service_tier"),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model=MODEL, input="Hello", **kwargs)
        assert e.value.code == "unsupported_parameter" and e.value.param == param, kwargs


# -- responses.stream and streamed retrieve -------------------------------------------------


def test_stream_helper_final_response(client):
    with client.responses.stream(model=MODEL, **COMPLETES) as stream:
        events = list(stream)
        final = stream.get_final_response()
    check_event_order(events)
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    # The helper adds the accumulated text to each delta.
    assert deltas[-1].snapshot == "".join(e.delta for e in deltas)
    assert final.status == "completed"
    assert final.output_text == deltas[-1].snapshot
    assert client.responses.retrieve(final.id).output_text == final.output_text


def test_stream_helper_resumes_background(client):
    r = client.responses.create(model=MODEL, background=True, **COMPLETES)
    after = 3
    with client.responses.stream(response_id=r.id, starting_after=after) as stream:
        events = list(stream)
        final = stream.get_final_response()
    check_event_order(events, start=after + 1)
    assert final.id == r.id
    assert final.status == "completed"
    assert final.output_text == wait_finished(client, r.id).output_text


def test_retrieve_stream_starting_after(client, server):
    """Resuming after `response.in_progress` parses in strict mode too."""
    r = client.responses.create(model=MODEL, background=True, **COMPLETES)
    done = wait_finished(client, r.id)
    log = raw_events(server, extra(r, "task_id"))
    after = next(e["sequence_number"] for e in log if e["type"] == "response.in_progress")
    events = list(client.responses.retrieve(r.id, stream=True, starting_after=after))
    assert events[0].type == "response.output_item.added"
    check_event_order(events, start=after + 1)
    assert events[-1].sequence_number == log[-1]["sequence_number"]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == done.output_text
    assert events[-1].response.output_text == text


def test_retrieve_stream_from_start(client):
    """`?stream=true` without `starting_after` replays the whole log from sequence 0."""
    r = client.responses.create(model=MODEL, **HELLO)
    events = list(client.responses.retrieve(r.id, stream=True))
    assert events[0].type == "response.created"
    check_event_order(events)
    assert events[-1].response.output_text == r.output_text


# -- cancel and delete ----------------------------------------------------------------------


def start_long(client: openai.OpenAI) -> Any:
    """A background response on the slow server, returned once it has produced some text."""
    r = client.responses.create(
        model=MODEL, input=LONG_PROMPT, temperature=0, max_output_tokens=2000, background=True
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        r = client.responses.retrieve(r.id)
        if r.status == "in_progress" and r.output_text:
            return r
        assert r.status in ("queued", "in_progress"), r.status
        time.sleep(0.02)
    raise AssertionError(f"{r.id} never started")


def test_cancel_background(slow_client):
    running = start_long(slow_client)
    cancelled = slow_client.responses.cancel(running.id)
    assert cancelled.id == running.id
    # `cancelling` is still `in_progress` on the wire; it ends `cancelled`.
    assert cancelled.status in ("in_progress", "cancelled")
    final = wait_finished(slow_client, running.id)
    assert final.status == "cancelled"
    # The text produced before the cancel stays in the output.
    assert final.output_text.startswith(running.output_text)
    assert final.usage is None or final.usage.output_tokens < 2000
    # Cancelling again returns it unchanged.
    again = slow_client.responses.cancel(running.id)
    assert again.model_dump() == final.model_dump()


def test_cancelled_event_reaches_sdk(slow_client):
    running = start_long(slow_client)
    slow_client.responses.cancel(running.id)
    events = list(slow_client.responses.retrieve(running.id, stream=True))
    types = [e.type for e in events]
    # `response.cancelling` stays on /tasks/{id}/events: the SDK's stream skips its number.
    numbers = [e.sequence_number for e in events]
    assert numbers == sorted(numbers) and len(numbers) == len(set(numbers))
    assert "response.cancelling" not in types and "response.loading" not in types
    # The spec has no cancelled event: the stream ends `response.incomplete`, its response
    # `cancelled` (strict-valid: the SDK's Response allows that status).
    assert types[-1] == "response.incomplete"
    assert sum(t in TERMINAL_EVENTS for t in types) == 1
    assert events[-1].response.id == running.id
    assert events[-1].response.status == "cancelled"


def test_cancel_finished_returns_it_unchanged(client):
    r = client.responses.create(model=MODEL, input="Hello there", max_output_tokens=SHORT)
    after = client.responses.cancel(r.id)
    assert after.status == r.status
    assert after.model_dump() == client.responses.retrieve(r.id).model_dump()
    assert after.output_text == r.output_text


def test_delete(client):
    r = client.responses.create(model=MODEL, input="Hello there", max_output_tokens=SHORT)
    assert client.responses.delete(r.id) is None
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)


# -- input, instructions, sampling, metadata, context ---------------------------------------


def test_input_items_auto_paging(client):
    turns = [
        {"role": "user", "content": "One"},
        {"role": "assistant", "content": "Two"},
        {"role": "user", "content": "Three"},
        {"role": "assistant", "content": "Four"},
        {"role": "user", "content": "Five"},
    ]
    r = client.responses.create(model=MODEL, input=turns, max_output_tokens=SHORT)
    first = client.responses.input_items.list(r.id, limit=2, order="asc")
    assert len(first.data) == 2
    assert first.has_more is True
    items = list(first)  # auto-paging: follows `after` until `has_more` is false
    assert [(i.type, i.role) for i in items] == [("message", t["role"]) for t in turns]
    assert [i.content[0].text for i in items] == [t["content"] for t in turns]
    assert len({i.id for i in items}) == len(turns)
    newest_first = list(client.responses.input_items.list(r.id, limit=2))
    assert {i.id for i in newest_first} == {i.id for i in items}


def test_max_output_tokens_incomplete(client):
    r = client.responses.create(model=MODEL, input=LONG_PROMPT, temperature=0, max_output_tokens=3)
    assert r.status == "incomplete"
    assert r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3
    assert r.max_output_tokens == 3


def test_instructions(client):
    common = {"model": MODEL, "input": "Hello there", "max_output_tokens": SHORT}
    plain = client.responses.create(**common)
    r = client.responses.create(instructions="Answer in one short sentence.", **common)
    assert r.instructions == "Answer in one short sentence."
    assert plain.instructions is None
    # The instructions went into the prompt as a system message.
    assert r.usage.input_tokens > plain.usage.input_tokens


def test_message_list_forms(client):
    """A string, an EasyInputMessage and a typed message with input_text parts are one prompt."""
    forms = [
        "What is the capital of France?",
        [{"role": "user", "content": "What is the capital of France?"}],
        [
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "What is the capital of France?"}],
            }
        ],
    ]
    results = [
        client.responses.create(
            model=MODEL, input=form, max_output_tokens=SHORT, extra_body={"seed": 7}
        )
        for form in forms
    ]
    assert len({r.output_text for r in results}) == 1
    assert len({r.usage.input_tokens for r in results}) == 1
    conversation = client.responses.create(
        model=MODEL,
        input=[
            {"role": "system", "content": "You are helpful."},
            {"role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello! How can I help?"},
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "A joke"}],
            },
        ],
        max_output_tokens=SHORT,
    )
    assert conversation.status in ("completed", "incomplete")
    assert conversation.usage.input_tokens > results[0].usage.input_tokens


def test_sampling_parameters_and_seed(client):
    def run(seed: int):
        return client.responses.create(
            model=MODEL,
            input="Hello there",
            max_output_tokens=SHORT,
            temperature=0.8,
            top_p=0.9,
            extra_body={"seed": seed},
        )

    a, b, c = run(1234), run(1234), run(4321)
    assert a.temperature == 0.8 and a.top_p == 0.9
    assert extra(a, "seed") == 1234
    assert a.output_text == b.output_text
    assert a.output_text != c.output_text


def test_metadata_echoed(client):
    metadata = {"run": "sdk-test", "purpose": "echo"}
    r = client.responses.create(
        model=MODEL, input="Hello there", max_output_tokens=SHORT, metadata=metadata
    )
    assert r.metadata == metadata
    assert client.responses.retrieve(r.id).metadata == metadata


def test_previous_response_id(client):
    first = client.responses.create(
        model=MODEL, input="My name is Ada.", max_output_tokens=SHORT, temperature=0
    )
    follow = {
        "model": MODEL,
        "input": "What is my name?",
        "max_output_tokens": SHORT,
        "temperature": 0,
    }
    standalone = client.responses.create(**follow)
    second = client.responses.create(previous_response_id=first.id, **follow)
    assert second.previous_response_id == first.id
    assert second.status in ("completed", "incomplete")
    assert second.output_text
    # The first turn (its input and its answer) is part of the second's prompt, give or take
    # a merge at the turn boundary.
    assert second.usage.input_tokens >= (
        standalone.usage.input_tokens + first.usage.input_tokens - 2
    )
    third = client.responses.create(
        model=MODEL, input="Thanks.", max_output_tokens=SHORT, previous_response_id=second.id
    )
    assert third.usage.input_tokens > second.usage.input_tokens


# -- chat completions -----------------------------------------------------------------------

CHAT = {
    "model": MODEL,
    "messages": [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "Hello"},
    ],
    "max_completion_tokens": SHORT,
    "temperature": 0,
}


def test_chat_completions(client):
    c = client.chat.completions.create(**CHAT)
    assert c.object == "chat.completion"
    assert c.model == MODEL
    [choice] = c.choices
    assert choice.index == 0
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert c.usage.prompt_tokens > 0
    assert 0 < c.usage.completion_tokens <= SHORT
    assert c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens


def test_chat_completions_stream(client):
    plain = client.chat.completions.create(**CHAT)
    chunks = list(client.chat.completions.create(stream=True, **CHAT))
    assert chunks
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    assert len({ch.id for ch in chunks}) == 1
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    # Greedy decoding: streamed and plain give the same text.
    assert text == plain.choices[0].message.content
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert finish[-1] == plain.choices[0].finish_reason
    assert all(f is None for f in finish[:-1])


# -- typed errors ---------------------------------------------------------------------------


# A schema whose pattern the grammar compiler cannot parse (strict or not).
BROKEN = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(unclosed"}}}


def test_bad_request_errors(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input=5)  # type: ignore[arg-type]
    assert e.value.status_code == 400
    assert e.value.param == "input"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(
            model=MODEL,
            input="Hello",
            tools=[{"type": "function", "name": "f", "parameters": BROKEN, "strict": False}],
        )
    # A schema the grammar compiler refuses: where in it, and the compiler's reason.
    assert e.value.code == "invalid_schema"
    assert e.value.param == "tools[0].parameters.properties.a.pattern"
    assert "/properties/a/pattern" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            **CHAT,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": BROKEN, "strict": True},
            },
        )
    assert e.value.code == "invalid_schema"
    assert e.value.param == "response_format.json_schema.schema.properties.a.pattern"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(
            model=MODEL,
            input=[
                {
                    "role": "user",
                    "content": [
                        {"type": "input_image", "image_url": "http://x/y.png", "detail": "auto"}
                    ],
                }
            ],
        )
    assert e.value.code == "unsupported_input"


def test_not_found_errors(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.retrieve("resp_doesnotexist")
    assert e.value.status_code == 404
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_doesnotexist")
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="no-such-model", input="Hello", max_output_tokens=SHORT)
    assert e.value.param == "model"
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(**{**CHAT, "model": "no-such-model"})
    assert e.value.param == "model"


def test_idempotency_key_replays(client):
    key = {"Idempotency-Key": f"sdk-{uuid.uuid4()}"}
    body = {"model": MODEL, "input": "Hello there", "max_output_tokens": SHORT}
    first = client.responses.with_raw_response.create(extra_headers=key, **body)
    again = client.responses.with_raw_response.create(extra_headers=key, **body)
    assert again.headers.get("Idempotent-Replayed") == "true"
    assert again.status_code == first.status_code
    assert again.parse().id == first.parse().id


def test_idempotency_key_mismatch(client):
    key = {"Idempotency-Key": f"sdk-{uuid.uuid4()}"}
    client.responses.create(model=MODEL, input="Hello", max_output_tokens=SHORT, extra_headers=key)
    with pytest.raises(openai.UnprocessableEntityError) as e:
        client.responses.create(
            model=MODEL, input="Goodbye", max_output_tokens=SHORT, extra_headers=key
        )
    assert e.value.status_code == 422
    assert e.value.code == "idempotency_key_mismatch"


def test_idempotency_key_in_use(slow_server, strict):
    """A second request with the key while the first is still running gets 409 (the SDK would
    retry it after Retry-After, so this client does not retry)."""
    key = {"Idempotency-Key": f"sdk-{uuid.uuid4()}"}
    body = {"model": MODEL, "input": LONG_PROMPT, "temperature": 0, "max_output_tokens": 60}
    first: dict[str, Any] = {}
    with make_client(slow_server, strict, max_retries=0) as c:

        def run_first() -> None:
            first["response"] = c.responses.create(extra_headers=key, **body)

        thread = threading.Thread(target=run_first)
        thread.start()
        try:
            with slow_server.client() as raw:
                deadline = time.monotonic() + 10
                while not raw.get("/tasks", params={"state": "running"}).json()["data"]:
                    assert time.monotonic() < deadline, "the first request never started"
                    time.sleep(0.02)
            with pytest.raises(openai.ConflictError) as e:
                c.responses.create(extra_headers=key, **body)
        finally:
            thread.join(30)
        assert e.value.code == "idempotency_key_in_use"
        assert "Retry-After" in e.value.response.headers
        assert first["response"].status == "incomplete"
        # Once the first has finished, the key replays its result.
        assert c.responses.create(extra_headers=key, **body).id == first["response"].id
