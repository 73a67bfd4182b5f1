"""The official `openai` Node SDK, unmodified apart from `baseURL` and `apiKey`, against a real
`jupyter server` running the extension (issue 36).

tests/node/sdk_client.mjs calls the SDK as its users do — `responses.create`, the
`responses.stream()` helper iterated event by event and then `finalResponse()`, a background
response polled with `retrieve` and followed again with `responses.stream({response_id,
starting_after})`, a function call streamed, answered with `previous_response_id` and listed
with `inputItems.list`, chat completions streamed (raw chunks and the `stream()` helper) — and
prints what it saw as JSON; the tests compare that with what the server stored, read over HTTP.

The SDK's stream helper throws on an event type it does not know (`unknown_event_canary` checks
that this SDK version still does), so a server event the SDK cannot handle fails these tests,
as `response.loading` once did. The packages come from tests/node/package-lock.json
(`make node-clients`); without them the tests skip, or fail when `CI` is set.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from nodeclients import require_node_clients
from sdkserver import MODEL, TOKEN, sdk_server
from serverproc import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

TEXT_EVENTS = [
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


@pytest.fixture(scope="module")
def node_dir() -> Path:
    return require_node_clients()


@pytest.fixture(scope="module")
def server(
    node_dir: Path, tmp_path_factory: pytest.TempPathFactory, test_model_dir: Path
) -> Iterator[ServerProcess]:
    with sdk_server(tmp_path_factory.mktemp("node-sdk"), test_model_dir) as s:
        yield s


def run_scenario(node_dir: Path, server: ServerProcess | None, scenario: str) -> Any:
    """What `scenario` of sdk_client.mjs saw, against `server` (None: no server at all)."""
    env = {
        **os.environ,
        # Port 9 (discard) on loopback: nothing listens there.
        "LMSP_BASE_URL": server.api if server is not None else "http://127.0.0.1:9/lmsp/v1",
        "LMSP_TOKEN": TOKEN,
        "LMSP_MODEL": MODEL,
        "NO_PROXY": "127.0.0.1,localhost",
    }
    ran = subprocess.run(
        ["node", "sdk_client.mjs", scenario],
        cwd=node_dir,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ran.returncode == 0, f"{scenario}: exit {ran.returncode}\n{ran.stderr}"
    return json.loads(ran.stdout)


def stored(server: ServerProcess, response_id: str) -> dict[str, Any]:
    with server.client() as http:
        r = http.get(f"/responses/{response_id}")
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def served_events(server: ServerProcess, response_id: str) -> list[dict[str, Any]]:
    """The response's events as the server streams them to any client (`GET /responses/{id}
    ?stream=true`, the stored log in the Responses API's event types), read here over HTTP."""
    events = []
    with (
        server.client() as http,
        http.stream("GET", f"/responses/{response_id}", params={"stream": "true"}) as r,
    ):
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data:"):
                events.append(json.loads(line[len("data:") :]))
    return events


def text_of(response: dict[str, Any]) -> str:
    return "".join(
        part["text"]
        for item in response["output"]
        if item["type"] == "message"
        for part in item["content"]
        if part["type"] == "output_text"
    )


def check_matches_stored(seen: dict[str, Any], server: ServerProcess) -> dict[str, Any]:
    """The SDK's response (id, status, output items, text, usage) is the stored one."""
    kept = stored(server, seen["id"])
    assert seen["status"] == kept["status"]
    assert seen["model"] == kept["model"] == MODEL
    assert seen["output_text"] == text_of(kept)
    assert [(i["type"], i["id"]) for i in seen["output"]] == [
        (i["type"], i["id"]) for i in kept["output"]
    ]
    assert seen["usage"]["output_tokens"] == kept["usage"]["output_tokens"]
    return kept


def check_text_stream(events: list[dict[str, Any]], start: int = 0) -> None:
    """Sequence numbers contiguous from `start`, one terminal event last, the message's
    events in order."""
    numbers = [e["sequence_number"] for e in events]
    assert numbers == list(range(start, start + len(events)))
    types = [e["type"] for e in events]
    assert types[-1] == "response.completed"
    ranks = [TEXT_EVENTS.index(t) for t in types if t in TEXT_EVENTS]
    assert ranks == sorted(ranks) and set(ranks) == set(range(len(TEXT_EVENTS))), types


def test_the_stream_helper_refuses_an_unknown_event(node_dir: Path) -> None:
    """Without a server: this SDK's `responses.stream()` throws on an event type it does not
    know, which is what makes the streaming tests below a check on the server's events."""
    seen = run_scenario(node_dir, None, "unknown_event_canary")
    assert seen["refused"] is True
    assert "response.loading" in seen["message"]


def test_create_and_retrieve(node_dir: Path, server: ServerProcess) -> None:
    seen = run_scenario(node_dir, server, "create")
    created = seen["created"]
    assert created["id"].startswith("resp_") and created["object"] == "response"
    assert created["status"] in ("completed", "incomplete") and created["output_text"]
    assert seen["retrieved"] == created
    check_matches_stored(created, server)


def test_stream_helper_and_final_response(node_dir: Path, server: ServerProcess) -> None:
    seen = run_scenario(node_dir, server, "stream")
    events, final = seen["events"], seen["final"]
    check_text_stream(events)
    assert events[0]["type"] == "response.created"
    assert final["status"] == "completed" and final["output_text"]
    # The helper's running snapshot ended at the final text.
    assert seen["text_snapshot"] == final["output_text"]
    check_matches_stored(final, server)
    # The SDK saw every event the server has for the response, in order.
    served = served_events(server, final["id"])
    assert events == [{k: e[k] for k in ("type", "sequence_number")} for e in served]


def test_create_stream_raw_events(node_dir: Path, server: ServerProcess) -> None:
    seen = run_scenario(node_dir, server, "create_stream")
    check_text_stream(seen["events"])
    final = seen["final"]
    kept = stored(server, final["id"])
    assert seen["deltas"] == text_of(kept) != ""
    assert final["status"] == kept["status"] == "completed"


def test_background_retrieve_and_resumed_stream(node_dir: Path, server: ServerProcess) -> None:
    seen = run_scenario(node_dir, server, "background")
    started, finished, resumed = seen["started"], seen["finished"], seen["resumed"]
    assert started["background"] is True and started["status"] in ("queued", "in_progress")
    assert finished["id"] == started["id"] and finished["status"] == "completed"
    check_matches_stored(finished, server)
    # Followed again after sequence number 2: the rest of the log, the same final response.
    check_text_stream(resumed["events"], start=3)
    assert resumed["final"] == finished
    served = served_events(server, started["id"])
    assert resumed["events"] == [{k: e[k] for k in ("type", "sequence_number")} for e in served[3:]]


def test_function_call_round_trip(node_dir: Path, server: ServerProcess) -> None:
    seen = run_scenario(node_dir, server, "tool_round_trip")
    asked, call, answered = seen["asked"], seen["call"], seen["answered"]
    types = [e["type"] for e in asked["events"]]
    assert "response.function_call_arguments.delta" in types
    assert "response.function_call_arguments.done" in types
    assert types[-1] == "response.completed"
    assert call["name"] == "get_weather" and call["call_id"]
    arguments = json.loads(call["arguments"])
    assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("c", "f")
    kept = check_matches_stored(asked["final"], server)
    [kept_call] = [i for i in kept["output"] if i["type"] == "function_call"]
    assert kept_call["arguments"] == call["arguments"]
    assert kept_call["call_id"] == call["call_id"]
    assert [i["type"] for i in answered["output"]] == ["message"]
    assert answered["status"] in ("completed", "incomplete")
    check_matches_stored(answered, server)
    assert seen["input_items"] == [{"type": "function_call_output", "call_id": call["call_id"]}]


def test_chat_completions_streaming(node_dir: Path, server: ServerProcess) -> None:
    seen = run_scenario(node_dir, server, "chat_stream")
    streamed, helper, plain = seen["streamed"], seen["helper"], seen["plain"]
    assert streamed["id"].startswith("chatcmpl") and streamed["chunks"] > 1
    assert streamed["text"] and streamed["finish_reason"] in ("stop", "length")
    # Greedy: the raw chunks, the helper's final completion and a plain call agree.
    assert helper["text"] == plain["text"] == streamed["text"]
    assert helper["finish_reason"] == plain["finish_reason"] == streamed["finish_reason"]
    assert helper["kinds"] == ["content"]


def test_authentication_error_is_the_sdks_class(node_dir: Path, server: ServerProcess) -> None:
    seen = run_scenario(node_dir, server, "auth_error")
    assert seen == {
        "class": "AuthenticationError",
        "is_authentication_error": True,
        "status": 401,
        "type": "authentication_error",
    }
