"""The background path end to end inside a real Jupyter Server (pytest-jupyter's jp_fetch):
202 with a committed task, MLX generation on the test model, events as JSON pages and SSE,
cancellation, and the task and service endpoints."""

from __future__ import annotations

import json
import sqlite3

import pytest
from jpserver import MODEL, ServerPool, call, server_config, token_delay, wait_state
from tornado.httpclient import HTTPClientError

pytest_plugins = ["pytest_jupyter.jupyter_server"]


@pytest.fixture(scope="module")
def server_pool(tmp_path_factory, test_model_dir):
    """One server for the module's tests (another for each `token_delay`): they need no fresh
    database, only to know which tasks they made themselves."""
    with ServerPool(tmp_path_factory, test_model_dir) as pool:
        yield pool


@pytest.fixture
def shared(server_pool, request):
    return server_pool.get(
        token_delay(request), lambda data: server_config(data, request, max_batch_size=1)
    )


@pytest.fixture
def shared_client(shared):
    client = shared.client()
    yield client
    client.close()


@pytest.fixture
def jp_fetch(shared_client):
    return shared_client.fetch


@pytest.fixture
def http_server_client(shared_client):
    return shared_client.client


@pytest.fixture
def jp_serverapp(shared):
    return shared.app


@pytest.fixture
def lmsp_data(shared):
    return shared.data_dir


async def test_background_response_is_committed_before_202(jp_fetch, lmsp_data):
    status, resp, headers = await call(
        jp_fetch,
        "POST",
        "responses",
        {"input": "Hello there", "background": True, "max_output_tokens": 12, "temperature": 0},
    )
    assert status == 202
    assert resp["object"] == "response" and resp["status"] == "queued"
    assert resp["output"] == [] and resp["model"] == MODEL
    assert headers["Location"].endswith(f"/lmsp/v1/responses/{resp['id']}")
    # A separate connection to the database file sees the task at once.
    with sqlite3.connect(lmsp_data / "lmsp.sqlite") as conn:
        row = conn.execute("select state from tasks where id = ?", (resp["task_id"],)).fetchone()
        assert row is not None
    task = await wait_state(jp_fetch, resp["task_id"], {"completed"})
    assert task["kind"] == "response"
    _, final, _ = await call(jp_fetch, "GET", f"responses/{resp['id']}")
    assert final["status"] == "incomplete"
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["usage"]["output_tokens"] == 12
    text = final["output"][0]["content"][0]["text"]
    assert text

    _, page, _ = await call(
        jp_fetch, "GET", f"tasks/{resp['task_id']}/events", params={"limit": 1000}
    )
    events = page["data"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    types = [e["type"] for e in events]
    assert types[0] == "response.created"
    assert types[-1] == "response.incomplete"
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == text
    assert types.index("response.loading") < types.index("response.in_progress")
    assert (
        sum(
            t
            in (
                "response.completed",
                "response.incomplete",
                "response.failed",
                "response.cancelled",
            )
            for t in types
        )
        == 1
    )


async def test_event_stream_sse_with_last_event_id(jp_fetch):
    _, resp, _ = await call(
        jp_fetch,
        "POST",
        "responses",
        {"input": "Stream me", "background": True, "max_output_tokens": 20, "temperature": 0},
    )
    task_id = resp["task_id"]
    await wait_state(jp_fetch, task_id, {"completed"})
    _, page, _ = await call(jp_fetch, "GET", f"tasks/{task_id}/events", params={"limit": 1000})
    all_events = page["data"]

    response = await jp_fetch(
        "lmsp",
        "v1",
        "tasks",
        task_id,
        "events",
        headers={"Accept": "text/event-stream", "Last-Event-ID": "3"},
    )
    assert response.headers["Content-Type"].startswith("text/event-stream")
    frames = parse_sse(response.body.decode())
    assert [f["id"] for f in frames] == [str(e["sequence_number"]) for e in all_events[4:]]
    assert [json.loads(f["data"]) for f in frames] == all_events[4:]
    assert all(f["event"] == json.loads(f["data"])["type"] for f in frames)


async def test_live_sse_follows_generation_to_the_end(jp_fetch):
    _, resp, _ = await call(
        jp_fetch,
        "POST",
        "responses",
        {
            "input": "Live",
            "background": True,
            "max_output_tokens": 40,
            "temperature": 0.8,
            "seed": 3,
        },
    )
    response = await jp_fetch("lmsp", "v1", "responses", resp["id"], params={"stream": "true"})
    frames = [json.loads(f["data"]) for f in parse_sse(response.body.decode())]
    assert [f["sequence_number"] for f in frames] == list(range(len(frames)))
    assert frames[0]["type"] == "response.created"
    assert frames[-1]["type"] == "response.incomplete"
    assert frames[-1]["response"]["output"][0]["content"][0]["text"] == "".join(
        f["delta"] for f in frames if f["type"] == "response.output_text.delta"
    )


async def test_task_list_filters_and_pages(jp_fetch):
    created = []
    for i in range(3):
        _, resp, _ = await call(
            jp_fetch,
            "POST",
            "responses",
            {"input": f"n{i}", "background": True, "max_output_tokens": 2},
        )
        created.append(resp["task_id"])
    for task_id in created:
        await wait_state(jp_fetch, task_id, {"completed"})
    _, page1, _ = await call(jp_fetch, "GET", "tasks", params={"limit": 2})
    assert len(page1["data"]) == 2 and page1["has_more"]
    _, page2, _ = await call(
        jp_fetch, "GET", "tasks", params={"limit": 2, "after": page1["last_id"]}
    )
    # Newest first; the tasks of earlier tests on this server come after these three.
    seen = [t["id"] for t in page1["data"] + page2["data"]]
    assert seen[:3] == list(reversed(created))
    # A filter lists these (and any earlier completed responses), nothing else.
    _, done, _ = await call(
        jp_fetch, "GET", "tasks", params={"state": "completed", "kind": "response", "limit": 100}
    )
    assert set(created) <= {t["id"] for t in done["data"]}
    assert all(t["state"] == "completed" and t["kind"] == "response" for t in done["data"])
    _, cancelled, _ = await call(jp_fetch, "GET", "tasks", params={"state": "cancelled"})
    assert not set(created) & {t["id"] for t in cancelled["data"]}
    status, body, _ = await call(jp_fetch, "GET", "tasks", params={"state": "sleeping"})
    assert status == 400 and body["error"]["param"] == "state"


async def test_service_identity_and_errors(jp_fetch):
    status, service, _ = await call(jp_fetch, "GET", "service")
    assert status == 200
    assert service["object"] == "service" and service["protocol"] == "lmsp/1.0"
    assert service["id"].startswith("svc_") and service["default_model"] == MODEL
    status, body, _ = await call(jp_fetch, "GET", "tasks/task_nope")
    assert status == 404 and body["error"]["type"] == "not_found_error"
    status, body, _ = await call(jp_fetch, "POST", "responses", {"input": "x", "model": "nope"})
    assert status == 404 and body["error"]["code"] == "model_not_found"
    status, body, _ = await call(jp_fetch, "POST", "responses", {"input": 3})
    assert status == 400 and body["error"]["param"] == "input"
    status, body, _ = await call(
        jp_fetch, "POST", "responses", {"input": "x", "tools": [{"type": "web_search"}]}
    )
    assert status == 400 and body["error"]["code"] == "unsupported_parameter"
    try:
        await jp_fetch("lmsp", "v1", "responses", method="POST", body="{not json")
    except HTTPClientError as e:
        assert e.code == 400
        assert json.loads(e.response.body)["error"]["code"] == "invalid_json"
    else:
        raise AssertionError("malformed JSON was accepted")


async def test_fields_real_clients_send_and_the_most_significant_refusal(jp_fetch):
    """Labels, hints and neutral values are accepted (with `stream_options` on a stream);
    of several fields the service cannot honour, the error names the most significant one,
    whatever the order of the body."""
    status, text, _ = await call(
        jp_fetch,
        "POST",
        "responses",
        {
            "input": "x",
            "max_output_tokens": 2,
            "stream": True,
            "stream_options": {"include_obfuscation": False},
            "user": "u",
            "safety_identifier": "s",
            "prompt_cache_key": "k",
            "service_tier": "auto",
            "top_logprobs": 0,
            "text": {"verbosity": "medium"},
            "max_tool_calls": None,
            "conversation": None,
        },
        raw=True,
    )
    assert status == 200 and parse_sse(text)[-1]["event"] in (
        "response.completed",
        "response.incomplete",
    )
    for body, param in (
        ({"service_tier": "flex", "text": {"verbosity": "low"}}, "text.verbosity"),
        ({"prompt": {"id": "p"}, "moderation": {"model": "m"}}, "prompt"),
        ({"colour": 1, "stream_options": {"include_obfuscation": True}}, None),
    ):
        status, error, _ = await call(jp_fetch, "POST", "responses", {"input": "x", **body})
        assert status == 400
        if param is None:
            assert error["error"]["code"] == "unsupported_parameter"
            assert error["error"]["param"] == "stream_options.include_obfuscation"
        else:
            assert error["error"] == {
                "type": "invalid_request_error",
                "code": "unsupported_parameter",
                "message": f"The parameter '{param}' with this value is not supported by "
                "this service.",
                "param": param,
            }


async def test_unauthenticated_request_gets_401(jp_fetch, jp_base_url, http_server_client):
    response = await http_server_client.fetch(f"{jp_base_url}lmsp/v1/service", raise_error=False)
    assert response.code in (401, 403)
    body = json.loads(response.body)
    assert "error" in body
    if response.code == 401:
        assert response.headers["WWW-Authenticate"].startswith("Bearer")


def parse_sse(text: str) -> list[dict[str, str]]:
    frames = []
    for block in text.split("\n\n"):
        fields: dict[str, str] = {}
        for line in block.splitlines():
            if not line or line.startswith(":"):
                continue
            name, _, value = line.partition(": ")
            fields[name] = value
        if fields:
            frames.append(fields)
    return frames


async def test_previous_response_id_carries_the_conversation(jp_fetch):
    _, first, _ = await call(
        jp_fetch,
        "POST",
        "responses",
        {"input": "My name is Ada.", "max_output_tokens": 6, "temperature": 0},
    )
    assert first["status"] in ("completed", "incomplete")
    _, second, _ = await call(
        jp_fetch,
        "POST",
        "responses",
        {"input": "What is my name?", "previous_response_id": first["id"], "max_output_tokens": 6},
    )
    assert second["previous_response_id"] == first["id"]
    # The second prompt holds the first turn (its input and its answer) before the new input.
    assert (
        second["usage"]["input_tokens"]
        > first["usage"]["input_tokens"] + first["usage"]["output_tokens"]
    )
    status, body, _ = await call(
        jp_fetch, "POST", "responses", {"input": "x", "previous_response_id": "resp_missing"}
    )
    assert status == 404 and body["error"]["param"] == "previous_response_id"


async def test_input_items_pages_and_delete(jp_fetch):
    messages = [{"role": "user", "content": f"message {i}"} for i in range(5)]
    _, resp, _ = await call(
        jp_fetch, "POST", "responses", {"input": messages, "max_output_tokens": 2}
    )
    seen, after = [], None
    while True:
        params = {"limit": 2, "order": "asc", **({"after": after} if after else {})}
        _, page, _ = await call(
            jp_fetch, "GET", f"responses/{resp['id']}/input_items", params=params
        )
        seen += [item["content"][0]["text"] for item in page["data"]]
        if not page["has_more"]:
            break
        after = page["last_id"]
    assert seen == [m["content"] for m in messages]
    _, desc, _ = await call(jp_fetch, "GET", f"responses/{resp['id']}/input_items")
    assert desc["data"][0]["content"][0]["text"] == "message 4"

    status, deleted, _ = await call(jp_fetch, "DELETE", f"responses/{resp['id']}")
    assert status == 200 and deleted == {
        "id": resp["id"],
        "object": "response.deleted",
        "deleted": True,
    }
    status, _, _ = await call(jp_fetch, "GET", f"responses/{resp['id']}")
    assert status == 404
    status, _, _ = await call(jp_fetch, "GET", f"tasks/{resp['task_id']}")
    assert status == 404

    _, running, _ = await call(
        jp_fetch,
        "POST",
        "responses",
        {"input": "long", "background": True, "max_output_tokens": 5000},
    )
    status, body, _ = await call(jp_fetch, "DELETE", f"responses/{running['id']}")
    assert status == 400 and body["error"]["code"] == "response_not_finished"
    await call(jp_fetch, "POST", f"responses/{running['id']}/cancel")


@pytest.mark.token_delay(0.02)
async def test_cancel_queued_and_running(jp_fetch):
    # Two long tasks: the first runs, the second waits its turn in the queue.
    ids = []
    for _ in range(2):
        _, resp, _ = await call(
            jp_fetch,
            "POST",
            "responses",
            {"input": "Long one", "background": True, "max_output_tokens": 5000, "temperature": 0},
        )
        ids.append(resp["task_id"])
    await wait_state(jp_fetch, ids[0], {"running"})
    status, queued, _ = await call(jp_fetch, "POST", f"tasks/{ids[1]}/cancel")
    assert status == 200 and queued["state"] == "cancelled"
    status, running, _ = await call(jp_fetch, "POST", f"tasks/{ids[0]}/cancel")
    assert running["state"] in ("cancelling", "cancelled")
    final = await wait_state(jp_fetch, ids[0], {"cancelled", "completed"})
    assert final["state"] == "cancelled"
    _, page, _ = await call(jp_fetch, "GET", f"tasks/{ids[0]}/events", params={"limit": 1000})
    assert page["data"][-1]["type"] == "response.cancelled"
    _, resp, _ = await call(jp_fetch, "GET", f"responses/{final['response_id']}")
    assert resp["status"] == "cancelled"
    # Cancelling a finished task changes nothing.
    status, again, _ = await call(jp_fetch, "POST", f"tasks/{ids[0]}/cancel")
    assert status == 200 and again["state"] == "cancelled"


@pytest.mark.token_delay(0.05)
async def test_a_cancel_hands_its_slot_to_the_next_task_at_once(jp_fetch, jp_serverapp, lmsp_data):
    """One slot: the task queued behind a running one is claimed as soon as the running one
    is cancelled, not after the cancel's own commit (the worker takes both in one turn).
    While it waits, the worker knows a task waits (so it stops a step part-way for the
    cancel: tests/test_interrupt.py)."""
    (extension,) = jp_serverapp.extension_manager.extension_apps["jupyter_lmsp"]
    ids = []
    for text in ("First", "Second"):
        _, resp, _ = await call(
            jp_fetch,
            "POST",
            "responses",
            {"input": text, "background": True, "max_output_tokens": 5000, "temperature": 0},
        )
        ids.append(resp["task_id"])
    await wait_state(jp_fetch, ids[0], {"running"})
    _, second, _ = await call(jp_fetch, "GET", f"tasks/{ids[1]}")
    assert second["state"] == "queued"
    engine = extension.ctx.runner.engine  # started by the first request
    assert engine.slots_wanted == 1
    await call(jp_fetch, "POST", f"tasks/{ids[0]}/cancel")
    await wait_state(jp_fetch, ids[1], {"running"})
    first = await wait_state(jp_fetch, ids[0], {"cancelled"})
    assert first["state"] == "cancelled"
    with sqlite3.connect(lmsp_data / "lmsp.sqlite") as conn:
        (loading,) = conn.execute(
            "select id from task_events where task_id = ? and type = 'response.loading'",
            (ids[1],),
        ).fetchone()
        (cancelled,) = conn.execute(
            "select id from task_events where task_id = ? and type = 'response.cancelled'",
            (ids[0],),
        ).fetchone()
    # The next task's claim was committed first.
    assert loading < cancelled
    assert engine.slots_wanted == 0
    await call(jp_fetch, "POST", f"tasks/{ids[1]}/cancel")
    assert (await wait_state(jp_fetch, ids[1], {"cancelled"}))["state"] == "cancelled"
