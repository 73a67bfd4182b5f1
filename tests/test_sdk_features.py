"""The openai SDK, unmodified, against a real server: structured outputs, function tools, stop
sequences, log-probabilities and several choices (issues 14 and 15), through both APIs.

Every test runs with lenient and with strict response validation (the `client` fixture);
streams are read with a lenient client, since they carry LMSP-only event types (see
test_openai_sdk). The model is the random-weight test model: what it writes is noise, but the
grammar holds it to the schema, and greedy or seeded decoding is reproducible.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from sdkserver import MODEL, sdk_server
from serverproc import ServerProcess
from test_openai_sdk import make_client, raw_events, strict  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["c", "f"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
RESPONSES_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": WEATHER,
    "strict": True,
}
CHAT_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": WEATHER,
        "strict": True,
    },
}
GREEDY: dict[str, Any] = {"temperature": 0}


class Person(BaseModel):
    name: str = Field(max_length=10)
    age: int = Field(ge=0, le=120)
    tags: list[str] = Field(max_length=3)


@pytest.fixture(scope="module")
def server(tmp_path_factory, test_model_dir) -> Iterator[ServerProcess]:
    with sdk_server(tmp_path_factory.mktemp("sdk-features"), test_model_dir) as s:
        yield s


@pytest.fixture
def client(server, strict) -> Iterator[openai.OpenAI]:  # noqa: F811
    with make_client(server, strict) as c:
        yield c


@pytest.fixture
def lenient(server) -> Iterator[openai.OpenAI]:
    with make_client(server, False) as c:
        yield c


def idle(server: ServerProcess, timeout: float = 60.0) -> None:
    """Wait until no task is unfinished: a test that compares two generations runs them
    alone (what shares a batch changes the arithmetic, and the random test model's nearly
    flat distributions make greedy picks sensitive to that)."""
    deadline = time.monotonic() + timeout
    with server.client() as c:
        while time.monotonic() < deadline:
            page = c.get(
                "/tasks",
                params=[("state", s) for s in ("queued", "loading", "running", "cancelling")],
            ).json()
            if not page["data"]:
                return
            time.sleep(0.05)
    raise AssertionError("tasks still unfinished")


def arguments_of(call: Any) -> dict[str, Any]:
    arguments = json.loads(call.arguments)
    jsonschema.validate(arguments, WEATHER)
    return arguments


# -- structured outputs ---------------------------------------------------------------------


def test_responses_parse_with_a_pydantic_model(client):
    r = client.responses.parse(
        model=MODEL, input="Who is she?", text_format=Person, max_output_tokens=400, **GREEDY
    )
    assert r.status == "completed"
    assert isinstance(r.output_parsed, Person)
    assert Person.model_validate_json(r.output_text) == r.output_parsed
    assert r.text.format.type == "json_schema" and r.text.format.name == "Person"
    # Stored: retrieved, the same JSON.
    assert client.responses.retrieve(r.id).output_text == r.output_text


def test_chat_completions_parse_with_a_pydantic_model(client):
    c = client.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Who is she?"}],
        response_format=Person,
        max_tokens=400,
        **GREEDY,
    )
    [choice] = c.choices
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Person)


def test_json_object_in_both_apis(client):
    r = client.responses.create(
        model=MODEL,
        input="Some JSON, please.",
        text={"format": {"type": "json_object"}},
        max_output_tokens=400,
        **GREEDY,
    )
    assert r.status == "completed"
    assert isinstance(json.loads(r.output_text), dict)
    c = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Some JSON, please."}],
        response_format={"type": "json_object"},
        max_tokens=400,
        **GREEDY,
    )
    assert isinstance(json.loads(c.choices[0].message.content), dict)


def test_a_schema_the_compiler_refuses_is_a_400_into_the_schema(client):
    schema = {"type": "object", "properties": {"a": {"type": "array", "contains": {}}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(
            model=MODEL,
            input="x",
            text={"format": {"type": "json_schema", "name": "s", "schema": schema, "strict": True}},
        )
    assert e.value.code == "invalid_schema"
    assert e.value.param == "text.format.schema.properties.a.contains"
    assert "contains" in e.value.message


# -- function tools -------------------------------------------------------------------------


def test_responses_tool_loop_through_previous_response_id(client):
    asked = client.responses.create(
        model=MODEL,
        input="What is the weather in Paris?",
        tools=[RESPONSES_TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=300,
        **GREEDY,
    )
    assert asked.status == "completed"
    assert asked.tools[0].name == "get_weather" and asked.tool_choice == "required"
    [call] = [item for item in asked.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.status == "completed"
    arguments_of(call)
    answered = client.responses.create(
        model=MODEL,
        previous_response_id=asked.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21"}],
        tools=[RESPONSES_TOOL],
        tool_choice="none",
        max_output_tokens=8,
        **GREEDY,
    )
    assert answered.status in ("completed", "incomplete")
    assert [item.type for item in answered.output] == ["message"]
    items = client.responses.input_items.list(answered.id).data
    assert [item.type for item in items] == ["function_call_output"]
    assert items[0].call_id == call.call_id


def test_responses_tool_loop_through_an_explicit_input_list(client):
    question = {"role": "user", "content": "What is the weather in Oslo?"}
    asked = client.responses.create(
        model=MODEL,
        input=[question],
        tools=[RESPONSES_TOOL],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=300,
        store=False,
        **GREEDY,
    )
    calls = [item for item in asked.output if item.type == "function_call"]
    assert calls
    history: list[Any] = [question]
    for call in calls:
        arguments_of(call)
        history.append(call.model_dump(exclude_none=True))
        history.append({"type": "function_call_output", "call_id": call.call_id, "output": "-3"})
    answered = client.responses.create(
        model=MODEL, input=history, tools=[RESPONSES_TOOL], max_output_tokens=8, **GREEDY
    )
    assert answered.status in ("completed", "incomplete")
    listed = [item.type for item in client.responses.input_items.list(answered.id, order="asc")]
    assert listed == ["message"] + ["function_call", "function_call_output"] * len(calls)


def test_streamed_responses_tool_call(lenient, server):
    with lenient.responses.stream(
        model=MODEL,
        input="Weather in Rome?",
        tools=[RESPONSES_TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=300,
        **GREEDY,
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert "response.function_call_arguments.delta" in types
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    [call] = [item for item in final.output if item.type == "function_call"]
    assert done.arguments == call.arguments
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(deltas) == call.arguments
    arguments_of(call)
    added = [e for e in events if e.type == "response.output_item.added"]
    assert added[0].item.type == "function_call" and added[0].item.name == "get_weather"
    # The stored log replays the same call.
    log = raw_events(server, final.model_extra["task_id"])
    assert [e["arguments"] for e in log if e["type"] == done.type] == [call.arguments]


def test_chat_tool_call_and_answer(client):
    messages: list[Any] = [{"role": "user", "content": "What is the weather in Lima?"}]
    asked = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=[CHAT_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False,
        max_tokens=300,
        **GREEDY,
    )
    [choice] = asked.choices
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    arguments_of(call.function)
    # As clients do: the SDK's message object, sent back as it is.
    messages.append(choice.message)
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "warm"})
    answered = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[CHAT_TOOL], max_tokens=6, **GREEDY
    )
    assert answered.choices[0].finish_reason in ("stop", "length")


def test_chat_streamed_tool_call_matches_the_plain_one(lenient, server):
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Weather?"}],
        "tools": [CHAT_TOOL],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_tokens": 300,
        **GREEDY,
    }
    idle(server)
    plain = lenient.chat.completions.create(**body)
    with lenient.chat.completions.stream(**body) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_completion()
    assert "tool_calls.function.arguments.delta" in kinds
    assert final.choices[0].finish_reason == "tool_calls"
    streamed = [
        (c.function.name, c.function.arguments) for c in final.choices[0].message.tool_calls
    ]
    expected = [
        (c.function.name, c.function.arguments) for c in plain.choices[0].message.tool_calls
    ]
    assert streamed == expected
    # The SDK parsed the strict tool's arguments.
    assert final.choices[0].message.tool_calls[0].function.parsed_arguments is not None


# -- stop sequences -------------------------------------------------------------------------


def stop_in(text: str) -> str:
    """A short piece of `text` (ASCII letters) after its start, to stop at."""
    for i in range(2, len(text) - 2):
        piece = text[i : i + 2]
        if piece.isascii() and piece.isalpha():
            return piece
    raise AssertionError(f"no stop sequence to pick in {text!r}")


def test_stop_sequences_in_both_apis(client, lenient, server):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hello there"}]}
    idle(server)
    full = client.chat.completions.create(**chat, max_tokens=24, **GREEDY)
    text = full.choices[0].message.content
    stop = stop_in(text)
    expected = text[: text.index(stop)]
    cut = client.chat.completions.create(
        **chat, max_tokens=24, stop=[stop, "never-there"], **GREEDY
    )
    assert cut.choices[0].message.content == expected
    assert cut.choices[0].finish_reason == "stop"
    chunks = list(
        lenient.chat.completions.create(**chat, max_tokens=24, stop=stop, stream=True, **GREEDY)
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    # An LMSP extension field on /responses: the SDK sends it as extra_body.
    r = client.responses.create(
        model=MODEL, input="Hello there", max_output_tokens=24, extra_body={"stop": stop}, **GREEDY
    )
    assert r.status == "completed"
    assert r.model_extra["stop"] == [stop]
    assert stop not in r.output_text


# -- log-probabilities ----------------------------------------------------------------------


def test_chat_logprobs(client):
    c = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hello there"}],
        logprobs=True,
        top_logprobs=3,
        max_tokens=8,
        **GREEDY,
    )
    [choice] = c.choices
    entries = choice.logprobs.content
    assert len(entries) == c.usage.completion_tokens
    for entry in entries:
        assert len(entry.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert entry.logprob <= 0
        assert [t.logprob for t in entry.top_logprobs] == sorted(
            (t.logprob for t in entry.top_logprobs), reverse=True
        )
    text = b"".join(bytes(entry.bytes) for entry in entries).decode("utf-8", "replace")
    assert text == choice.message.content


def test_responses_logprobs_are_stored_and_replayed(client, server):
    r = client.responses.create(
        model=MODEL,
        input="Hello there",
        include=["message.output_text.logprobs"],
        top_logprobs=2,
        max_output_tokens=8,
        **GREEDY,
    )
    assert r.top_logprobs == 2
    logprobs = r.output[0].content[0].logprobs
    assert len(logprobs) == r.usage.output_tokens
    assert all(len(entry.top_logprobs) == 2 for entry in logprobs)
    again = client.responses.retrieve(r.id)
    assert again.output[0].content[0].logprobs == logprobs
    log = raw_events(server, r.model_extra["task_id"])
    replayed = [
        entry for e in log if e["type"] == "response.output_text.delta" for entry in e["logprobs"]
    ]
    assert replayed == [entry.model_dump() for entry in logprobs]
    # Without the include, none.
    plain = client.responses.create(model=MODEL, input="Hello there", max_output_tokens=4)
    assert plain.output[0].content[0].logprobs == []


# -- several choices ------------------------------------------------------------------------


def test_n_choices_are_reproducible_with_a_seed(client, lenient, server):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say something."}],
        "n": 3,
        "seed": 1234,
        "temperature": 1.0,
        "max_tokens": 8,
        "logprobs": True,
        "top_logprobs": 1,
    }
    idle(server)
    first = client.chat.completions.create(**body)
    assert [c.index for c in first.choices] == [0, 1, 2]
    texts = [c.message.content for c in first.choices]
    assert len(set(texts)) > 1, texts
    second = client.chat.completions.create(**body)
    assert [c.message.content for c in second.choices] == texts
    # Streamed, each chunk names its choice.
    streamed = ["", "", ""]
    for chunk in lenient.chat.completions.create(**body, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert streamed == texts
    # The response behind it holds one message per choice; its item events say whose.
    response_id = first.model_extra["response_id"]
    stored = client.responses.retrieve(response_id)
    assert sorted(item.content[0].text for item in stored.output) == sorted(texts)
    log = raw_events(server, first.model_extra["task_id"])
    added = [e for e in log if e["type"] == "response.output_item.added"]
    assert sorted(e["choice"] for e in added) == [0, 1, 2]
    # Each choice's tokens are counted, and each has its own log-probabilities.
    assert first.usage.completion_tokens == sum(len(c.logprobs.content) for c in first.choices)
    assert [c.logprobs.content for c in second.choices] == [
        c.logprobs.content for c in first.choices
    ]


def test_n_above_the_maximum_is_refused(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], n=5
        )
    assert e.value.param == "n"


# -- the demo model -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo_server(tmp_path_factory, demo_model_dir) -> Iterator[ServerProcess]:
    """A server whose default model is the demo model (SmolLM2-135M-Instruct)."""
    with sdk_server(tmp_path_factory.mktemp("sdk-demo"), demo_model_dir) as s:
        yield s


def test_the_demo_model_completes_a_tool_loop(demo_server, strict):  # noqa: F811
    """The standard loop on the demo model, forced to call (small models do not call
    unforced): it asks, the client runs the function, the model answers in text."""
    with make_client(demo_server, strict) as client:
        asked = client.responses.create(
            model=MODEL,
            input="What is the weather in Paris? Use the tool.",
            tools=[RESPONSES_TOOL],
            tool_choice="required",
            parallel_tool_calls=False,
            max_output_tokens=200,
            temperature=0,
        )
        assert asked.status == "completed"
        [call] = [item for item in asked.output if item.type == "function_call"]
        arguments = arguments_of(call)
        assert arguments["city"]
        answered = client.responses.create(
            model=MODEL,
            previous_response_id=asked.id,
            input=[
                {
                    "type": "function_call_output",
                    "call_id": call.call_id,
                    "output": json.dumps({"city": arguments["city"], "weather": "sunny, 21 C"}),
                }
            ],
            tools=[RESPONSES_TOOL],
            max_output_tokens=60,
            temperature=0,
        )
        assert answered.status in ("completed", "incomplete")
        assert answered.output_text.strip()
        assert all(item.type == "message" for item in answered.output)


def test_the_demo_model_parses_a_float_field(demo_server, strict):  # noqa: F811
    """Issue 43: at temperature 0 the demo model once wrote a float field's digits until
    `max_output_tokens` (180 of them); numbers are bounded, so `responses.parse` gets an
    object."""

    class City(BaseModel):
        name: str
        country: str
        population_millions: float

    with make_client(demo_server, strict) as client:
        parsed = client.responses.parse(
            model=MODEL,
            input="Describe Tokyo: its name, country and population in millions.",
            text_format=City,
            temperature=0,
            max_output_tokens=200,
        )
        assert parsed.status == "completed", parsed.output_text
        assert isinstance(parsed.output_parsed, City), parsed.output_text
        assert parsed.output_parsed.name


def test_a_call_cut_by_the_token_limit_is_incomplete(client):
    # The random model pads the JSON with whitespace: the smallest of these limits that ends
    # inside the call (its name known, its arguments not closed).
    for limit in (40, 60, 80, 120):
        asked = client.responses.create(
            model=MODEL,
            input="Weather?",
            tools=[RESPONSES_TOOL],
            tool_choice="required",
            max_output_tokens=limit,
            **GREEDY,
        )
        if asked.output:
            break
    assert asked.status == "incomplete"
    assert asked.incomplete_details.reason == "max_output_tokens"
    [call] = asked.output
    assert call.type == "function_call" and call.status == "incomplete"
    with pytest.raises(json.JSONDecodeError):
        json.loads(call.arguments)
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather?"}],
        tools=[CHAT_TOOL],
        tool_choice="required",
        max_tokens=limit,
        **GREEDY,
    )
    assert chat.choices[0].finish_reason == "length"
    assert chat.choices[0].message.tool_calls


# -- several choices take several rows ------------------------------------------------------


def test_n_choices_take_n_rows_until_cancelled(lmsp_data):
    """A chat completion of n choices holds n of the batch's rows: with all four taken, a
    response waits queued, and it starts once the completion is cancelled (its rows freed)."""
    server = ServerProcess(lmsp_data, max_batch_size=4, engine_token_delay=0.05)
    with server.start(), server.client() as c:
        body = {
            "messages": [{"role": "user", "content": "Tell me a story."}],
            "n": 4,
            "max_tokens": 2000,
            "temperature": 0,
            "stream": True,
        }
        head: dict[str, Any] = {}
        got_head = threading.Event()

        def chat() -> None:
            with server.client() as own, own.stream("POST", "/chat/completions", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {") and not head:
                        head.update(json.loads(line[6:]))
                        got_head.set()

        reader = threading.Thread(target=chat, daemon=True)
        reader.start()
        assert got_head.wait(30)
        chat_task = head["task_id"]
        deadline = time.monotonic() + 30
        while c.get(f"/tasks/{chat_task}").json()["state"] != "running":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        waiting = c.post(
            "/responses", json={"input": "Hi", "background": True, "max_output_tokens": 4}
        ).json()
        time.sleep(1.0)  # many decode steps: it would have started by now if a row were free
        assert c.get(f"/tasks/{waiting['task_id']}").json()["state"] == "queued"
        assert c.post(f"/tasks/{chat_task}/cancel").status_code == 200
        deadline = time.monotonic() + 30
        while c.get(f"/tasks/{waiting['task_id']}").json()["state"] == "queued":
            assert time.monotonic() < deadline, "the cancelled completion's rows were not freed"
            time.sleep(0.05)
        assert c.get(f"/tasks/{chat_task}").json()["state"] in ("cancelling", "cancelled")
        reader.join(30)
