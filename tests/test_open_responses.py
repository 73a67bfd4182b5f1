"""The Open Responses conformance tier: every object and event the service emits, in the cases
of the spec's compliance suite (basic, streaming, system prompt, tool calling plain and
streamed, multi-turn, image input), checked against the spec's required fields and types
(tests/openresponses_spec.py, written here from the spec's OpenAPI document), and Codex's
first request replayed from its description (issue 36).

The test model has random weights: the cases check the protocol, not what the text says. Where a
case of the suite needs the model to choose a tool, `tool_choice: "required"` makes it call one.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from openresponses_spec import RESPONSE, TERMINAL, event_problems, problems
from sdkserver import MODEL, sdk_server
from serverproc import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

# Greedy, and short enough to end `completed` quickly on the test model.
GREEDY: dict[str, Any] = {"temperature": 0, "max_output_tokens": 256}
# A closed set of places: the random test model's call ends soon (a free string runs on).
WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather for a location",
    "parameters": {
        "type": "object",
        "properties": {
            "location": {"type": "string", "enum": ["Oslo", "Paris"]},
        },
        "required": ["location"],
    },
}
FREE_WEATHER_TOOL = {
    **WEATHER_TOOL,
    "parameters": {
        "type": "object",
        "properties": {"location": {"type": "string"}},
        "required": ["location"],
    },
}
WEATHER = [{"type": "message", "role": "user", "content": "What's the weather in Oslo?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory, test_model_dir) -> Iterator[ServerProcess]:
    with sdk_server(tmp_path_factory.mktemp("openresponses"), test_model_dir) as s:
        yield s


@pytest.fixture
def http(server) -> Iterator[httpx.Client]:
    with server.client() as c:
        yield c


def create(http: httpx.Client, body: dict[str, Any]) -> dict[str, Any]:
    r = http.post("/responses", json={"model": MODEL, **body})
    assert r.status_code == 200, r.text
    response = r.json()
    assert problems(response, RESPONSE) == []
    return response


def sse_events(r: httpx.Response) -> list[dict[str, Any]]:
    """The `data` of every SSE frame, each checked against the frame's `event` line."""
    events: list[dict[str, Any]] = []
    kind = None
    for line in r.iter_lines():
        if line.startswith("event:"):
            kind = line[6:].strip()
        elif line.startswith("data:"):
            event = json.loads(line[5:].strip())
            assert event["type"] == kind
            events.append(event)
    return events


def stream(http: httpx.Client, body: dict[str, Any]) -> list[dict[str, Any]]:
    with http.stream("POST", "/responses", json={"model": MODEL, "stream": True, **body}) as r:
        assert r.status_code == 200, r.read()
        return checked_stream(sse_events(r))


def checked_stream(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every event is one of the spec's, with its required fields; sequence numbers rise; one
    terminal event, last; every lifecycle snapshot is one response."""
    for event in events:
        assert event_problems(event) == [], event
    numbers = [e["sequence_number"] for e in events]
    assert numbers == sorted(numbers) and len(set(numbers)) == len(numbers)
    types = [e["type"] for e in events]
    assert [t for t in types if t in TERMINAL] == [types[-1]], types
    ids = {e["response"]["id"] for e in events if "response" in e}
    assert len(ids) == 1
    # An interim snapshot holds only items already announced (`output_item.added`), as the
    # openai SDKs' stream helpers count them (the Node one refuses a second item at an index).
    added: set[str] = set()
    for event in events:
        if event["type"] == "response.output_item.added":
            added.add(event["item"]["id"])
        elif event["type"] in ("response.created", "response.queued", "response.in_progress"):
            assert {item["id"] for item in event["response"]["output"]} <= added, event
    return events


def test_basic_response(http):
    response = create(
        http,
        {"input": [{"type": "message", "role": "user", "content": "Hello"}], **GREEDY},
    )
    assert response["status"] == "completed" and response["output"]
    # The request's sampling, echoed as the spec types them.
    assert response["temperature"] == 0 and response["top_p"] == 1
    assert response["presence_penalty"] == 0 and response["frequency_penalty"] == 0
    assert response["top_logprobs"] == 0 and response["service_tier"] == "default"
    assert response["reasoning"] == {"effort": None, "summary": None}


def test_streaming_response(http):
    events = stream(http, {"input": [{"type": "message", "role": "user", "content": "Hello"}]})
    types = [e["type"] for e in events]
    assert types[0] == "response.created" and types[-1] == "response.completed"
    # The model's loading is `response.queued` here (LMSP's own types stay on /tasks/{id}/events).
    assert "response.queued" in types and "response.loading" not in types
    assert types.index("response.queued") < types.index("response.in_progress")
    assert events[-1]["response"]["status"] == "completed"
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == text


def test_system_prompt(http):
    response = create(
        http,
        {
            "input": [
                {"type": "message", "role": "system", "content": "You are a pirate."},
                {"type": "message", "role": "user", "content": "Hello"},
            ],
            **GREEDY,
        },
    )
    assert response["status"] == "completed" and response["output"]


def test_tool_calling(http):
    response = create(
        http,
        {"input": WEATHER, "tools": [WEATHER_TOOL], "tool_choice": "required", **GREEDY},
    )
    calls = [item for item in response["output"] if item["type"] == "function_call"]
    assert calls and all(c["name"] == "get_weather" for c in calls)
    json.loads(calls[0]["arguments"])
    assert response["tools"] == [{**WEATHER_TOOL, "strict": True}]


def test_tool_calling_streamed(http):
    events = stream(
        http, {"input": WEATHER, "tools": [WEATHER_TOOL], "tool_choice": "required", **GREEDY}
    )
    added = [e for e in events if e["type"] == "response.output_item.added"]
    done = [e for e in events if e["type"] == "response.output_item.done"]
    assert any(e["item"]["type"] == "function_call" for e in added)
    assert any(e["item"]["type"] == "function_call" for e in done)
    for item_done in done:
        if item_done["item"]["type"] != "function_call":
            continue
        item_id = item_done["item"]["id"]
        mine = [e for e in events if e.get("item_id") == item_id]
        kinds = [e["type"] for e in mine]
        assert "response.function_call_arguments.delta" in kinds
        # The arguments are closed before the item.
        (args_done,) = [e for e in mine if e["type"] == "response.function_call_arguments.done"]
        assert args_done["sequence_number"] < item_done["sequence_number"]
        assert args_done["arguments"] == item_done["item"]["arguments"]


def test_a_cut_off_call_closes_its_arguments_before_its_item(http):
    """An output limit that stops a call midway: `function_call_arguments.done` with what was
    written, then the incomplete item."""
    events = stream(
        http,
        {
            "input": WEATHER,
            "tools": [FREE_WEATHER_TOOL],
            "tool_choice": "required",
            "temperature": 0,
            "max_output_tokens": 48,
        },
    )
    assert events[-1]["type"] == "response.incomplete"
    (item_done,) = [e for e in events if e["type"] == "response.output_item.done"]
    assert item_done["item"]["status"] == "incomplete"
    (args_done,) = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert args_done["sequence_number"] < item_done["sequence_number"]
    assert args_done["arguments"] == item_done["item"]["arguments"]


def test_multi_turn(http):
    response = create(
        http,
        {
            "input": [
                {"type": "message", "role": "user", "content": "My name is Alice."},
                {"type": "message", "role": "assistant", "content": "Hello Alice!"},
                {"type": "message", "role": "user", "content": "What is my name?"},
            ],
            **GREEDY,
        },
    )
    # The random test model may run to the output limit here: the protocol is what is checked.
    assert response["status"] in ("completed", "incomplete") and response["output"]


def test_image_input_is_a_clear_400(http):
    r = http.post(
        "/responses",
        json={
            "model": MODEL,
            "input": [
                {
                    "type": "message",
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "What is in this image?"},
                        {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0K"},
                    ],
                }
            ],
        },
    )
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["code"] == "unsupported_input" and error["param"] == "input[0].content[1]"


def test_background_retrieval_and_its_stream(http):
    r = http.post("/responses", json={"model": MODEL, "input": "Hello", "background": True})
    assert r.status_code == 202
    queued = r.json()
    assert problems(queued, RESPONSE) == [] and queued["background"] is True
    with http.stream("GET", f"/responses/{queued['id']}", params={"stream": "true"}) as s:
        events = checked_stream(sse_events(s))
    assert events[0]["type"] == "response.created"
    retrieved = http.get(f"/responses/{queued['id']}").json()
    assert problems(retrieved, RESPONSE) == []
    assert retrieved["status"] == events[-1]["response"]["status"]


def test_request_fields_are_echoed(http):
    response = create(
        http,
        {
            "input": "Hello",
            "safety_identifier": "user-1234",
            "prompt_cache_key": "session-7",
            "service_tier": "auto",
            "presence_penalty": 0.5,
            "frequency_penalty": -0.25,
            "reasoning": {"summary": "auto"},
            "include": ["reasoning.encrypted_content"],
            "client_metadata": {"originator": "test"},
            "text": {"verbosity": "medium"},
            **GREEDY,
        },
    )
    assert response["safety_identifier"] == "user-1234"
    assert response["prompt_cache_key"] == "session-7"
    assert response["service_tier"] == "default"
    assert response["presence_penalty"] == 0.5 and response["frequency_penalty"] == -0.25
    assert response["reasoning"] == {"effort": None, "summary": "auto"}
    # OpenAI does not echo client_metadata; it is stored with the request.
    assert "client_metadata" not in response


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("service_tier", "scale"),
        ("include", ["file_search_call.results"]),
        ("reasoning", {"effort": "high"}),
    ],
)
def test_what_cannot_be_honoured_is_a_400_naming_it(http, field, value):
    r = http.post("/responses", json={"model": MODEL, "input": "Hello", field: value})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "unsupported_parameter"
    assert error["param"].split(".")[0].split("[")[0] == field


def test_allowed_tools_offers_only_those(http):
    other = {**WEATHER_TOOL, "name": "get_time", "description": "The time"}
    response = create(
        http,
        {
            "input": WEATHER,
            "tools": [WEATHER_TOOL, other],
            "tool_choice": {
                "type": "allowed_tools",
                "mode": "required",
                "tools": [{"type": "function", "name": "get_time"}],
            },
            **GREEDY,
        },
    )
    calls = [item for item in response["output"] if item["type"] == "function_call"]
    assert calls and {c["name"] for c in calls} == {"get_time"}
    assert response["tool_choice"]["type"] == "allowed_tools"
    r = http.post(
        "/responses",
        json={
            "model": MODEL,
            "input": "x",
            "tools": [WEATHER_TOOL],
            "tool_choice": {
                "type": "allowed_tools",
                "mode": "auto",
                "tools": [{"type": "function", "name": "nope"}],
            },
        },
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice.tools[0].name"


def test_parallel_tool_calls_false_is_at_most_one_call(http):
    response = create(
        http,
        {
            "input": WEATHER,
            "tools": [WEATHER_TOOL],
            "tool_choice": "required",
            "parallel_tool_calls": False,
            **GREEDY,
        },
    )
    calls = [item for item in response["output"] if item["type"] == "function_call"]
    assert len(calls) == 1 and response["parallel_tool_calls"] is False


# -- Codex's first request (issue 36), from its description as Codex CLI 0.171 sends it -------

SHELL_TOOL = {
    "type": "function",
    "name": "shell",
    "description": "Runs a shell command and returns its output.",
    "strict": False,
    "parameters": {
        "type": "object",
        "properties": {
            "command": {"type": "array", "items": {"type": "string"}},
            "workdir": {"type": "string"},
        },
        "required": ["command"],
        "additionalProperties": False,
    },
}
AGENTS_NAMESPACE = {
    "type": "namespace",
    "name": "multi_agent_v1",
    "description": "Start and wait for helper agents.",
    "tools": [
        {
            "type": "function",
            "name": "spawn_agent",
            "description": "Start an agent on a task.",
            "strict": False,
            "parameters": {
                "type": "object",
                "properties": {"task": {"type": "string"}},
                "required": ["task"],
            },
        },
        {
            "type": "function",
            "name": "wait_agent",
            "description": "Wait for an agent to finish.",
            "strict": False,
            "parameters": {"type": "object", "properties": {"id": {"type": "string"}}},
        },
    ],
}


def codex_request(**changes: Any) -> dict[str, Any]:
    """The shape of Codex CLI's first request with default settings: streamed, not stored, a
    prompt cache key, tools (functions and a namespace), reasoning summary, encrypted
    reasoning included, client metadata, developer messages instead of instructions, no
    max_output_tokens."""
    return {
        "model": MODEL,
        "input": [
            {
                "type": "message",
                "role": "developer",
                "content": [
                    {"type": "input_text", "text": "You are a coding agent in a terminal."}
                ],
            },
            {
                "type": "message",
                "role": "developer",
                "content": [{"type": "input_text", "text": "Sandbox: workspace-write."}],
            },
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "List the files here."}],
            },
        ],
        "tools": [SHELL_TOOL, AGENTS_NAMESPACE],
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "reasoning": {"summary": "auto"},
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "0f5e7c1a-codex-session",
        "client_metadata": {"x-codex-installation-id": "test-installation"},
        **changes,
    }


def codex_stream(http: httpx.Client, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The stream of a Codex-shaped request, checked against the spec. The spec has no
    namespace tools (OpenAI's, which Codex sends): each snapshot's `tools` echoes the namespace
    as sent, and is checked apart, with the functions it holds as function tools."""
    with http.stream("POST", "/responses", json=body) as r:
        assert r.status_code == 200, r.read()
        events = sse_events(r)
    for event in events:
        if "response" in event:
            tools = event["response"]["tools"]
            assert tools == body["tools"]
            flat = [f for t in tools for f in (t["tools"] if t["type"] == "namespace" else [t])]
            event["response"] = {**event["response"], "tools": flat}
    return checked_stream(events)


def test_codex_first_request_is_accepted(http):
    # Greedy, and bounded, so the random test model ends soon (Codex sends no limit).
    events = codex_stream(http, codex_request(temperature=0, max_output_tokens=64))
    final = events[-1]["response"]
    assert final["status"] in ("completed", "incomplete")
    assert final["store"] is False and final["prompt_cache_key"] == "0f5e7c1a-codex-session"
    assert final["parallel_tool_calls"] is False
    # The namespace was echoed as sent (codex_stream checks), its functions flattened here.
    assert [t["name"] for t in final["tools"]] == ["shell", "spawn_agent", "wait_agent"]


def test_a_namespaced_call_names_its_namespace_and_goes_back_as_input(http):
    choice = {
        "type": "allowed_tools",
        "mode": "required",
        "tools": [{"type": "function", "name": "spawn_agent"}],
    }
    events = codex_stream(http, codex_request(tool_choice=choice, **GREEDY))
    calls = [
        e["item"]
        for e in events
        if e["type"] == "response.output_item.done" and e["item"]["type"] == "function_call"
    ]
    assert calls and all(c["name"] == "spawn_agent" for c in calls)
    assert all(c["namespace"] == "multi_agent_v1" for c in calls)
    added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
    assert all(item.get("namespace") == "multi_agent_v1" for item in added)
    final_calls = [i for i in events[-1]["response"]["output"] if i["type"] == "function_call"]
    assert all(c["namespace"] == "multi_agent_v1" for c in final_calls)
    # Codex sends the call back, namespace and all, with its output.
    call = calls[0]
    follow_up = codex_request(
        input=[
            *codex_request()["input"],
            {k: call[k] for k in ("type", "call_id", "name", "arguments", "namespace")},
            {"type": "function_call_output", "call_id": call["call_id"], "output": "agent-1"},
        ],
        **GREEDY,
    )
    final = codex_stream(http, follow_up)[-1]["response"]
    assert final["status"] in ("completed", "incomplete")


def test_namespaced_functions_must_have_distinct_names(http):
    clash = {**AGENTS_NAMESPACE, "tools": [{**SHELL_TOOL}]}
    r = http.post("/responses", json=codex_request(tools=[SHELL_TOOL, clash], stream=False))
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"


# -- store: false ------------------------------------------------------------------------------


def test_an_unstored_response_is_gone_once_finished(http):
    """`store: false`: the request gets its answer (plain or streamed), then the response is
    not retrievable, not streamable, not listable, and cannot be continued: 404."""
    answered = create(http, {"input": "Hello", "store": False, **GREEDY})
    assert answered["store"] is False and answered["status"] == "completed"
    events = stream(http, {"input": "Hello", "store": False, **GREEDY})
    streamed = events[-1]["response"]["id"]
    for response_id in (answered["id"], streamed):
        for path, params in (
            (f"/responses/{response_id}", {}),
            (f"/responses/{response_id}", {"stream": "true"}),
            (f"/responses/{response_id}/input_items", {}),
        ):
            r = http.get(path, params=params)
            assert r.status_code == 404, (path, params, r.text)
        r = http.post(
            "/responses",
            json={"model": MODEL, "input": "Again", "previous_response_id": response_id},
        )
        assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"
    # Its rows are gone too: the owner does not find its task.
    for task_id in (answered["task_id"], events[-1]["response"]["task_id"]):
        assert http.get(f"/tasks/{task_id}").status_code == 404
    # A stored one stays.
    kept = create(http, {"input": "Hello", **GREEDY})
    assert http.get(f"/responses/{kept['id']}").status_code == 200
    assert http.get(f"/tasks/{kept['task_id']}").status_code == 200


# -- the default output limit ----------------------------------------------------------------


@pytest.mark.parametrize(("default", "expected"), [(0, None), (5, 5)])
def test_without_max_output_tokens_the_window_is_the_limit(
    tmp_path, test_model_dir, default, expected
):
    """No `max_output_tokens`: the output may fill what the context window leaves (as OpenAI
    has it), unless the owner set `max_output_tokens_default`. Greedy, this prompt runs for
    hundreds of tokens on the test model, so it stops at the limit."""
    window = 64
    with (
        sdk_server(
            tmp_path, test_model_dir, max_context_tokens=window, max_output_tokens_default=default
        ) as server,
        server.client() as c,
    ):
        r = c.post("/responses", json={"input": "Tell me a story.", "temperature": 0})
        assert r.status_code == 200, r.text
        done = r.json()
        assert done["status"] == "incomplete" and done["max_output_tokens"] is None
        usage = done["usage"]
        assert usage["output_tokens"] == (expected or window - usage["input_tokens"])
        assert c.get("/service").json()["limits"]["max_output_tokens_default"] == default
