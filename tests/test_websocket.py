"""The WebSocket mode of `/responses` (issue 36; handlers/websocket.py) against a real server
with the test model, through Tornado's WebSocket client: `response.create` streams the same
events the SSE stream carries (each checked against the Open Responses spec); turns follow each
other on one socket; bad messages get `error` messages and the socket goes on; a stored response
outlives its socket and a new socket follows it from the last sequence number, with no gap and
nothing twice; an unstored one stops with its socket; credentials are needed before the upgrade;
and the openai SDK's own WebSocket client (`client.responses.connect()`) works unmodified.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from sdkserver import MODEL, TOKEN, sdk_server
from serverproc import ServerProcess
from test_open_responses import checked_stream, sse_events
from tornado.httpclient import HTTPClientError, HTTPRequest
from tornado.websocket import WebSocketClientConnection, websocket_connect

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SHORT: dict[str, Any] = {"model": MODEL, "temperature": 0, "max_output_tokens": 12}
LONG: dict[str, Any] = {**SHORT, "max_output_tokens": 300, "input": "Tell me a story."}
TERMINAL = {"response.completed", "response.incomplete", "response.failed", "error"}


@pytest.fixture(scope="module")
def server(tmp_path_factory, test_model_dir) -> Iterator[ServerProcess]:
    # Paced steps, so that a socket can be closed while its response runs.
    with sdk_server(
        tmp_path_factory.mktemp("websocket"), test_model_dir, engine_token_delay=0.05
    ) as s:
        yield s


def ws_url(server: ServerProcess) -> str:
    return server.api.replace("http://", "ws://") + "/responses"


async def connect(server: ServerProcess, headers: dict | None = None) -> WebSocketClientConnection:
    request = HTTPRequest(ws_url(server), headers=server.headers if headers is None else headers)
    return await websocket_connect(request)


async def read_until(conn: WebSocketClientConnection, stop: Any) -> list[dict[str, Any]]:
    """Messages until `stop(message)` is true (that one included)."""
    out: list[dict[str, Any]] = []
    while True:
        raw = await asyncio.wait_for(conn.read_message(), 60)
        assert raw is not None, out
        out.append(json.loads(raw))
        if stop(out[-1]):
            return out


async def shut(conn: WebSocketClientConnection) -> None:
    """Close the socket and wait until it is closed (its closing handshake done): a socket
    still open when the test's event loop ends is a ResourceWarning."""
    conn.close()
    while await asyncio.wait_for(conn.read_message(), 30) is not None:
        pass


def ended(message: dict[str, Any]) -> bool:
    return message["type"] in TERMINAL


def kinds(events: list[dict[str, Any]]) -> list[str]:
    """The events' types, a run of text deltas as one."""
    out: list[str] = []
    for event in events:
        if not (out and out[-1] == event["type"] == "response.output_text.delta"):
            out.append(event["type"])
    return out


def send(conn: WebSocketClientConnection, message: dict[str, Any] | str) -> None:
    conn.write_message(message if isinstance(message, str) else json.dumps(message))


def test_a_create_streams_what_the_sse_stream_carries(server):
    async def over_socket() -> list[dict[str, Any]]:
        conn = await connect(server)
        send(conn, {"type": "response.create", "input": "Hello", **SHORT})
        events = await read_until(conn, ended)
        await shut(conn)
        return events

    events = checked_stream(asyncio.run(over_socket()))
    with (
        server.client() as http,
        http.stream("POST", "/responses", json={"input": "Hello", "stream": True, **SHORT}) as r,
    ):
        sse = checked_stream(sse_events(r))
    # The same events (how many deltas the text came in depends on the commits' timing).
    assert kinds(events) == kinds(sse)
    assert (
        events[-1]["response"]["output"][0]["content"]
        == sse[-1]["response"]["output"][0]["content"]
    )
    # The response is stored as any other: retrievable, and its log is what the socket carried.
    with server.client() as http:
        response_id = events[0]["response"]["id"]
        assert http.get(f"/responses/{response_id}").json() == events[-1]["response"]
        with http.stream("GET", f"/responses/{response_id}", params={"stream": "true"}) as r:
            assert sse_events(r) == events


def test_turns_follow_each_other_on_one_socket(server):
    async def run() -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
        conn = await connect(server)
        # Two creates sent at once are answered one after the other.
        send(conn, {"type": "response.create", "input": "One.", **SHORT})
        send(conn, {"type": "response.create", "input": "Two.", **SHORT})
        first = await read_until(conn, ended)
        second = await read_until(conn, ended)
        send(
            conn,
            {
                "type": "response.create",
                "input": "Three.",
                "previous_response_id": second[0]["response"]["id"],
                **SHORT,
            },
        )
        third = await read_until(conn, ended)
        await shut(conn)
        return first, second, third

    first, second, third = asyncio.run(run())
    for events in (first, second, third):
        checked_stream(events)
    assert first[0]["response"]["id"] != second[0]["response"]["id"]
    # The third continued the second: its prompt holds the second turn too.
    final = third[-1]["response"]
    assert final["previous_response_id"] == second[0]["response"]["id"]
    assert final["usage"]["input_tokens"] > second[-1]["response"]["usage"]["input_tokens"]


BAD_MESSAGES: list[tuple[Any, int, str, str | None]] = [
    ("not json", 400, "invalid_json", None),
    ([1, 2], 400, "invalid_json", None),
    ({"type": "response.nope"}, 400, "invalid_value", "type"),
    ({"input": "Hi"}, 400, "missing_required_parameter", "type"),
    (
        {"type": "response.create", "input": "Hi", "stream": True},
        400,
        "unsupported_parameter",
        "stream",
    ),
    (
        {"type": "response.create", "input": "Hi", "background": True},
        400,
        "unsupported_parameter",
        "background",
    ),
    ({"type": "response.create", "input": "Hi", "model": "nope"}, 404, "model_not_found", "model"),
    (
        {"type": "response.create", "input": "Hi", "temperature": 9},
        400,
        "invalid_value",
        "temperature",
    ),
    ({"type": "response.follow", "response_id": "resp_nope"}, 404, "not_found", None),
]


def test_bad_messages_get_errors_and_the_socket_goes_on(server):
    async def run() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        conn = await connect(server)
        errors = []
        for message, _, _, _ in BAD_MESSAGES:
            send(conn, message if isinstance(message, str | dict) else json.dumps(message))
            errors += await read_until(conn, lambda m: True)
        send(conn, {"type": "response.create", "input": "Still there?", **SHORT})
        events = await read_until(conn, ended)
        await shut(conn)
        return errors, events

    errors, events = asyncio.run(run())
    for error, (message, status, code, param) in zip(errors, BAD_MESSAGES, strict=True):
        assert error["type"] == "error", (message, error)
        assert error["status"] == status and error["error"]["code"] == code, (message, error)
        assert set(error["error"]) == {"type", "code", "message", "param"}
        if param is not None:
            assert error["error"]["param"] == param, (message, error)
    assert events[-1]["type"] in ("response.completed", "response.incomplete")


def test_a_new_socket_follows_a_stored_response_from_the_last_event(server):
    async def run() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        conn = await connect(server)
        send(conn, {"type": "response.create", **LONG})
        seen = await read_until(conn, lambda m: m["type"] == "response.output_text.delta")
        seen += await read_until(conn, lambda m: m["type"] == "response.output_text.delta")
        await shut(conn)
        await asyncio.sleep(0.3)  # the response goes on without a socket
        again = await connect(server)
        send(
            again,
            {
                "type": "response.follow",
                "response_id": seen[0]["response"]["id"],
                "starting_after": seen[-1]["sequence_number"],
            },
        )
        rest = await read_until(again, ended)
        await shut(again)
        return seen, rest

    seen, rest = asyncio.run(run())
    events = checked_stream(seen + rest)
    assert [e["sequence_number"] for e in events] == sorted({e["sequence_number"] for e in events})
    assert events[-1]["type"] == "response.incomplete"  # it ran to its limit
    with (
        server.client() as http,
        http.stream(
            "GET", f"/responses/{events[0]['response']['id']}", params={"stream": "true"}
        ) as r,
    ):
        assert sse_events(r) == events


def test_an_unstored_response_stops_when_its_socket_closes(server):
    async def run() -> str:
        conn = await connect(server)
        send(conn, {"type": "response.create", "store": False, **LONG})
        seen = await read_until(conn, lambda m: m["type"] == "response.output_text.delta")
        await shut(conn)
        return str(seen[0]["response"]["task_id"])

    task_id = asyncio.run(run())
    # Stopped (and then gone, as any finished unstored response): within seconds, where its
    # 300 paced tokens would take 15 s or more.
    with server.client() as http:
        deadline = time.monotonic() + 10
        while (r := http.get(f"/tasks/{task_id}")).status_code == 200:
            state = r.json()["state"]
            assert state in ("running", "cancelling", "cancelled"), r.json()
            if state == "cancelled":
                break
            assert time.monotonic() < deadline, r.json()
            time.sleep(0.05)


def test_credentials_come_before_the_upgrade(server):
    async def refused(headers: dict[str, str]) -> int:
        with pytest.raises(HTTPClientError) as e:
            await connect(server, headers)
        return e.value.code

    assert asyncio.run(refused({})) == 401
    assert asyncio.run(refused({"Authorization": "Bearer lmsp_not-a-token"})) == 401
    # A plain GET of /responses is no operation.
    r = httpx.get(f"{server.api}/responses", headers=server.headers)
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"


# The SDK opens its socket with websockets' `connect()` outside a `with`, which websockets 17
# deprecates: a warning from the SDK's code, not ours.
@pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager")
def test_the_openai_sdk_websocket_client_works_as_it_is(server):
    """`client.responses.connect()` of the openai SDK (3.57), unmodified: it sends
    `response.create` and parses every event the socket carries."""
    with (
        openai.OpenAI(base_url=server.api, api_key=TOKEN, max_retries=0) as client,
        client.responses.connect() as conn,
    ):
        conn.response.create(input="Hello", **SHORT)
        types = []
        for event in conn:
            types.append(event.type)
            if event.type in TERMINAL:
                break
        final = event.response
        conn.response.create(input="Again.", previous_response_id=final.id, **SHORT)
        for event in conn:
            if event.type in TERMINAL:
                break
    assert types[0] == "response.created" and types[-1] in (
        "response.completed",
        "response.incomplete",
    )
    assert "response.output_text.delta" in types
    assert event.response.previous_response_id == final.id
    assert final.output_text
