"""A client that goes away (issue 36): the response it alone could read stops, within a decode
step, and its batch row goes to the next request; background work, and a plain stored
response its client may retrieve later, go on.

One real server with the test model, one batch row, and slow steps (0.4 s a token), so that a
step is long beside the path of a cancel (the close seen on the loop, its commit, the word to
the worker): "within one step" is counted in the stored log, not timed.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from serverproc import ServerProcess, with_test_model
from test_crash_recovery import deltas, events, finished, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

STEP = 0.4
LONG = {"input": "Tell me a story about a robot.", "temperature": 0, "max_output_tokens": 400}


@pytest.fixture(scope="module")
def server(tmp_path_factory, test_model_dir) -> Iterator[ServerProcess]:
    data = with_test_model(tmp_path_factory.mktemp("disconnect"), test_model_dir)
    with ServerProcess(
        data, engine_token_delay=STEP, snapshot_interval=0.01, max_batch_size=1
    ) as s:
        yield s


def read_until_deltas(server: ServerProcess, body: dict, count: int) -> tuple[str, int]:
    """POST a streamed response, read its SSE until `count` text deltas arrived, then drop the
    connection. Returns its task id and the sequence number of the last event read."""
    with (
        server.client(timeout=60) as c,
        c.stream("POST", "/responses", json={**body, "stream": True}) as r,
    ):
        assert r.status_code == 200
        task_id, last, seen = None, -1, 0
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            last = event["sequence_number"]
            if event["type"] == "response.created":
                task_id = event["response"]["task_id"]
            seen += event["type"] == "response.output_text.delta"
            if seen >= count:
                break
    assert task_id is not None
    return task_id, last


def test_a_streamed_response_stops_within_a_step_when_its_client_leaves(server):
    task_id, last_read = read_until_deltas(server, LONG, 3)
    with server.client() as c:
        # The row it held goes to the next request: this one (queued behind it) completes.
        r = c.post("/responses", json={**LONG, "max_output_tokens": 4, "background": True})
        assert r.status_code == 202, r.text
        task, log = wait_for(c, task_id, finished)
        assert task["state"] == "cancelled", task
        # What was generated after the last event the client read: the step in flight and
        # the one decoded ahead of it at most, never the 400 tokens asked for.
        assert len(deltas(log[last_read + 1 :])) <= 2, log[last_read + 1 :]
        assert log[-1]["type"] == "response.cancelled"
        nxt, _ = wait_for(c, r.json()["task_id"], finished)
        assert nxt["state"] == "completed", nxt


def task_ids(server: ServerProcess) -> set[str]:
    with server.client() as c:
        page = c.get("/tasks", params={"limit": 100}).json()
    assert not page["has_more"]
    return {task["id"] for task in page["data"]}


def post_and_give_up(server: ServerProcess, body: dict, wait: float) -> str:
    """POST a plain response and leave after `wait` seconds; the id of the task it made (seen
    running before the client leaves)."""
    before = task_ids(server)
    outcome: dict = {}

    def post() -> None:
        with server.client(timeout=wait) as c:
            try:
                c.post("/responses", json=body)
            except httpx.ReadTimeout as e:
                outcome["timeout"] = e

    thread = threading.Thread(target=post)
    thread.start()
    new: set[str] = set()
    while not new and thread.is_alive():
        new = task_ids(server) - before
    thread.join()
    assert "timeout" in outcome  # the client gave up before an answer
    [task_id] = new
    return task_id


def test_a_plain_unstored_response_stops_when_its_client_gives_up(server):
    task_id = post_and_give_up(server, {**LONG, "store": False}, STEP * 6)
    # Stopped, and then gone as any finished unstored response is once its request ended:
    # within seconds, where its 400 tokens would take 160 s.
    with server.client() as c:
        deadline = time.monotonic() + 40
        while (r := c.get(f"/tasks/{task_id}")).status_code == 200:
            assert not finished(r.json(), None) or r.json()["state"] == "cancelled", r.json()
            assert time.monotonic() < deadline, r.json()
            time.sleep(0.05)
        assert r.status_code == 404


@pytest.mark.parametrize("shape", ["background-stream", "plain-stored"])
def test_work_its_client_may_come_back_for_goes_on(server, shape):
    body = {**LONG, "max_output_tokens": 12}
    with server.client() as c:
        if shape == "background-stream":
            task_id, _ = read_until_deltas(server, {**body, "background": True}, 2)
        else:
            task_id = post_and_give_up(server, body, STEP * 3)
        task, log = wait_for(c, task_id, finished)
        assert task["state"] == "completed", task
        assert log[-1]["response"]["usage"]["output_tokens"] == 12
        # The stored response is there to retrieve, whole (it ran to its limit).
        final = log[-1]["response"]
        assert final["incomplete_details"] == {"reason": "max_output_tokens"}
        assert c.get(f"/responses/{final['id']}").json() == final
        assert events(c, task_id) == log
