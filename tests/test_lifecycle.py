"""The caller-wide lifecycle stream (`GET /lifecycle`, issue 18) on a real server: live
transitions of every task of the caller in commit order, a reconnect with `Last-Event-ID` that
misses and repeats nothing, what a paired client sees, and a revoked client's stream closing."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx
import pytest
from securityhelpers import bearer, pair, wait_task
from serverproc import TOKEN, ServerProcess

from jupyter_lmsp.protocol.tasks import LIFECYCLE_STATES

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

TERMINAL = {"completed", "failed", "cancelled"}


def frames(
    client: httpx.Client, until, headers=None, params=None, timeout=60.0, opened=None
) -> list[dict]:
    """SSE frames of `/lifecycle` (id, event and data checked together) until `until(frames)`.

    `opened()` is called once the 200 is in: the server has fixed the stream's starting point
    before it answers (LifecycleStream.start), so what is committed after is on the stream.
    """
    out: list[dict[str, Any]] = []
    frame: dict[str, str] = {}
    deadline = time.monotonic() + timeout
    with client.stream(
        "GET",
        "/lifecycle",
        headers={"Accept": "text/event-stream", **(headers or {})},
        params=params,
    ) as r:
        assert r.status_code == 200, r.read()
        if opened is not None:
            opened()
        for line in r.iter_lines():
            assert time.monotonic() < deadline, out
            if line.startswith(("id: ", "event: ", "data: ")):
                name, _, value = line.partition(": ")
                frame[name] = value
            elif not line and frame:
                data = json.loads(frame["data"])
                assert int(frame["id"]) == data["sequence_number"]
                assert frame["event"] == data["type"]
                out.append(data)
                frame = {}
                if until(out):
                    return out
    raise AssertionError(f"the stream ended: {out}")


def ended(task_ids):
    def done(out):
        return {e["task_id"] for e in out if e["state"] in TERMINAL} >= set(task_ids)

    return done


def test_live_transitions_then_a_reconnect(lmsp_data):
    with ServerProcess(lmsp_data, engine_token_delay=0.02) as server, server.client() as c:
        got: list[dict] = []
        ids: list[str] = []
        ready = threading.Event()

        def follow():
            def until(out):
                return len(ids) == 2 and ended(ids)(out)

            with server.client() as watcher:
                got.extend(frames(watcher, until, opened=ready.set))

        reader = threading.Thread(target=follow)
        reader.start()
        assert ready.wait(60), "the lifecycle stream never opened"
        # Greedy: sampled at the default temperature, the test model may end on EOS within the
        # four tokens (the task then completes rather than stopping incomplete).
        done = c.post(
            "/responses",
            json={"input": "a", "background": True, "max_output_tokens": 4, "temperature": 0},
        )
        long = c.post(
            "/responses", json={"input": "b", "background": True, "max_output_tokens": 500}
        ).json()
        ids.extend([done.json()["task_id"], long["task_id"]])
        wait_task(c, long["task_id"], lambda t: t["state"] == "running")
        c.post(f"/tasks/{long['task_id']}/cancel")
        reader.join(60)
        assert not reader.is_alive()

        numbers = [e["sequence_number"] for e in got]
        assert numbers == sorted(numbers) and len(set(numbers)) == len(numbers)
        for task_id, last in ((ids[0], "response.incomplete"), (ids[1], "response.cancelled")):
            mine = [e for e in got if e["task_id"] == task_id]
            types = [e["type"] for e in mine]
            assert types[0] == "response.created" and types[-1] == last, types
            assert "response.in_progress" in types
            # Exactly the task log's lifecycle events, in its order.
            log = c.get(f"/tasks/{task_id}/events", params={"limit": 1000}).json()["data"]
            lifecycle = [e for e in log if e["type"] in LIFECYCLE_STATES]
            assert [e["sequence_number"] for e in lifecycle] == [
                e["task_sequence_number"] for e in mine
            ]

        # A reconnect after the third frame gets the rest, nothing missed or repeated; `after`
        # does the same, and `Last-Event-ID` wins over it.
        rest = frames(
            c,
            lambda out: len(out) == len(got) - 3,
            headers={"Last-Event-ID": str(got[2]["sequence_number"])},
            params={"after": 0},
        )
        assert rest == got[3:]
        assert frames(c, lambda out: len(out) == len(got), params={"after": -1}) == got


def test_a_paired_client_sees_its_own_tasks_and_is_cut_off_when_revoked(lmsp_data):
    with ServerProcess(lmsp_data) as server, server.client() as own:
        client = pair(server, "board", ["tasks:read", "responses:write"])
        narrow = pair(server, "narrow", ["responses:write"])
        with bearer(server, narrow["access_token"]) as c:
            r = c.get("/lifecycle")
            assert r.status_code == 403 and r.json()["error"]["code"] == "insufficient_scope"
        owner_task = own.post("/responses", json={"input": "mine", "max_output_tokens": 2}).json()
        with bearer(server, client["access_token"]) as c:
            theirs = c.post("/responses", json={"input": "theirs", "max_output_tokens": 2}).json()
            seen = frames(c, ended([theirs["task_id"]]), params={"after": -1})
        assert {e["task_id"] for e in seen} == {theirs["task_id"]}
        # The Jupyter user sees its own and the client's it paired.
        everything = frames(
            own, ended([owner_task["task_id"], theirs["task_id"]]), params={"after": -1}
        )
        assert {e["task_id"] for e in everything} == {owner_task["task_id"], theirs["task_id"]}

        opened, closed = threading.Event(), threading.Event()

        def follow():
            with bearer(server, client["access_token"]) as c, c.stream("GET", "/lifecycle") as r:
                if r.status_code == 200:
                    opened.set()
                    for _ in r.iter_lines():
                        pass
            closed.set()

        reader = threading.Thread(target=follow, daemon=True)
        reader.start()
        assert opened.wait(30), "the client's lifecycle stream never opened"
        assert not closed.is_set()
        assert own.delete(f"/clients/{client['client_id']}").status_code == 200
        assert closed.wait(10), "the revoked client's lifecycle stream stayed open"


def test_the_task_board_follows_the_lifecycle_stream(lmsp_data):
    """The notebook TaskBoard lists the tasks once, then places each transition as it comes:
    with a poll interval of a minute, new tasks still show at once and reach their end."""
    from jupyter_lmsp.client import Client
    from jupyter_lmsp.widgets import TaskBoard

    with ServerProcess(lmsp_data) as server, server.client() as c:
        early = c.post("/responses", json={"input": "before", "max_output_tokens": 2}).json()
        client = Client(server.url, TOKEN)
        board = TaskBoard(client, interval=60.0)
        try:
            deadline = time.monotonic() + 30
            while board.mode != "lifecycle" or not board.table.rows:
                assert time.monotonic() < deadline, board
                time.sleep(0.05)
            assert [r["id"] for r in board.table.rows] == [early["task_id"]]
            made = [
                c.post(
                    "/responses",
                    json={"input": f"n{i}", "background": True, "max_output_tokens": 3},
                ).json()["task_id"]
                for i in range(2)
            ]
            while {r["id"]: r["state"] for r in board.table.rows} != {
                early["task_id"]: "completed",
                made[0]: "completed",
                made[1]: "completed",
            }:
                assert time.monotonic() < deadline, board.table.rows
                time.sleep(0.05)
            assert [r["id"] for r in board.table.rows] == [made[1], made[0], early["task_id"]]
            assert board.polls == 1  # the one list when the stream opened
            board.state_filter = "failed"
            board.wait_for_poll()
            assert board.table.rows == [] and board.mode == "lifecycle"
        finally:
            board.close()
            client.close()


def test_bad_starting_points_and_missing_credentials(lmsp_data):
    with ServerProcess(lmsp_data) as server, server.client() as c:
        for params, headers in (
            ({"after": "-2"}, {}),
            ({"after": "x"}, {}),
            ({"after": str(2**63)}, {}),
            ({}, {"Last-Event-ID": "nope"}),
            ({}, {"Last-Event-ID": "-5"}),
        ):
            r = c.get("/lifecycle", params=params, headers=headers)
            assert r.status_code == 400, (params, headers, r.text)
            assert r.json()["error"]["type"] == "invalid_request_error"
        r = httpx.get(f"{server.api}/lifecycle")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_token"


def test_a_read_covers_the_text_events_after_the_last_transition(tmp_path):
    """The stream's next read starts after the newest event read over, not after the last
    transition: text events are not scanned again on every read."""
    from storehelpers import make_task, open_db, query

    from jupyter_lmsp.services.lifecycle import TYPES
    from jupyter_lmsp.store import queries

    db = open_db(tmp_path)
    try:
        task_id = make_task(db, "running")  # created, loading, in_progress, then text events
        (top,) = query(db, "SELECT MAX(id) FROM task_events")[0]
        rows, cursor = queries.lifecycle_events(db, -1, TYPES)
        assert [r.type for r in rows] == [
            "response.created",
            "response.loading",
            "response.in_progress",
        ]
        assert rows[-1].id < top and cursor == top
        assert queries.lifecycle_events(db, cursor, TYPES) == ([], top)
        # A full page ends at its last row, so the rest is read next.
        rows, cursor = queries.lifecycle_events(db, -1, TYPES, limit=2)
        assert len(rows) == 2 and cursor == rows[-1].id
        rows, _ = queries.lifecycle_events(db, cursor, TYPES)
        assert [r.task_id for r in rows] == [task_id]
    finally:
        db.dispose()
