"""Hardening (issue 12, finding 5): one client must not monopolise generation and storage.
Against a real server: prompts beyond the model's context window are refused and output is
capped at what the window leaves, a paired client's quotas answer 429 with `Retry-After`,
callers take turns for the decoding slots, and a request's input is stored once."""

from __future__ import annotations

import sqlite3
import time

import pytest
from securityhelpers import bearer, database, events, pair, wait_task
from serverproc import ServerProcess

from jupyter_lmsp.engine.worker import encode_chat

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

WRITER = ["responses:write", "responses:read", "tasks:read", "tasks:write"]
SLOW = {"engine_token_delay": 0.02, "snapshot_interval": 0.02}


def prompt_of(tokenizer, tokens: int) -> tuple[str, int]:
    """An input whose rendered prompt has exactly `tokens` tokens for the test model."""
    words = 1
    while True:
        text = " ".join(["a"] * words)  # one token per word for the test model
        n = len(encode_chat(tokenizer, [{"role": "user", "content": text}]))
        if n == tokens:
            return text, n
        if n > tokens:
            raise AssertionError(f"no input renders to exactly {tokens} tokens")
        words += 1


def test_the_context_window_is_enforced_and_output_capped(lmsp_data, tokenizer):
    window = 64
    with (
        ServerProcess(lmsp_data, max_context_tokens=window) as server,
        server.client() as owner,
    ):
        text, n = prompt_of(tokenizer, window - 10)
        # A limit far beyond the window is capped at what the window leaves.
        r = owner.post(
            "/responses",
            json={"input": text, "background": True, "temperature": 0, "max_output_tokens": 10**12},
        )
        assert r.status_code == 202, r.text
        task = wait_task(owner, r.json()["task_id"], timeout=60)
        done = owner.get(f"/responses/{r.json()['id']}").json()
        assert task["state"] == "completed" and done["status"] == "incomplete", done
        # The count the server checked is the worker's own.
        assert done["usage"]["input_tokens"] == n
        assert done["usage"]["output_tokens"] == window - n

        longest, m = prompt_of(tokenizer, window - 1)  # leaves one token: accepted
        r = owner.post("/responses", json={"input": longest, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["output_tokens"] == 1, r.text
        assert r.json()["usage"]["input_tokens"] == m

        too_long, _ = prompt_of(tokenizer, window)
        for path, body, param in (
            ("/responses", {"input": too_long}, "input"),
            ("/responses", {"input": "water " * 5000, "background": True}, "input"),
            (
                "/chat/completions",
                {"messages": [{"role": "user", "content": too_long}]},
                "messages",
            ),
        ):
            r = owner.post(path, json=body)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["code"] == "context_length_exceeded" and error["param"] == param
        conn = database(lmsp_data)  # nothing was stored for the refused ones
        try:
            assert conn.execute("SELECT COUNT(*) FROM tasks").fetchone()[0] == 2
        finally:
            conn.close()


def test_a_clients_quotas_answer_429_and_the_owner_has_none(lmsp_data):
    with ServerProcess(
        lmsp_data, client_max_tasks=3, client_max_tokens=9000, max_batch_size=1, **SLOW
    ) as server:
        c = pair(server, "greedy", WRITER)
        with bearer(server, c["access_token"]) as client, server.client() as owner:
            small = {"input": "hi", "background": True, "max_output_tokens": 500}
            made = [client.post("/responses", json=small) for _ in range(3)]
            assert [r.status_code for r in made] == [202, 202, 202]
            r = client.post("/responses", json=small, headers={"Idempotency-Key": "again"})
            assert r.status_code == 429, r.text
            assert r.json()["error"]["code"] == "too_many_tasks"
            assert int(r.headers["Retry-After"]) >= 1
            for _ in range(5):  # the owner is not limited
                assert owner.post("/responses", json=small).status_code == 202
            # Room again once one ends; the key of the refused request was not used up.
            client.post(f"/responses/{made[0].json()['id']}/cancel")
            wait_task(client, made[0].json()["task_id"])
            r = client.post("/responses", json=small, headers={"Idempotency-Key": "again"})
            assert r.status_code == 202, r.text
            assert "Idempotent-Replayed" not in r.headers
            for response in [*made[1:], r]:
                client.post(f"/responses/{response.json()['id']}/cancel")
                wait_task(client, response.json()["task_id"])
            # Tokens in flight: each huge request holds (about) a whole 4096-token window.
            huge = {"input": "hi", "background": True, "max_output_tokens": 10**12}
            statuses = [client.post("/responses", json=huge) for _ in range(3)]
            assert [r.status_code for r in statuses[:2]] == [202, 202]
            assert statuses[2].status_code == 429
            assert statuses[2].json()["error"]["code"] == "too_many_tokens_in_flight"


def test_a_clients_stored_output_is_bounded_and_freed_by_deleting(lmsp_data):
    # Issue 43: finished tasks counted against nothing. A limit of one byte: the first
    # response is admitted (nothing kept yet), the next is a 403 until it is deleted.
    with ServerProcess(lmsp_data, client_max_stored_bytes=1) as server:
        c = pair(server, "keeper", WRITER)
        with bearer(server, c["access_token"]) as client, server.client() as owner:
            small = {"input": "hi", "max_output_tokens": 4}
            first = client.post("/responses", json=small)
            assert first.status_code == 200, first.text
            refused = client.post("/responses", json=small)
            assert refused.status_code == 403, refused.text
            error = refused.json()["error"]
            assert (error["code"], error["type"]) == (
                "storage_quota_exceeded",
                "insufficient_quota",
            )
            assert owner.post("/responses", json=small).status_code == 200  # no quota
            assert client.delete(f"/responses/{first.json()['id']}").status_code == 200
            assert client.post("/responses", json=small).status_code == 200


def _started_at(data_dir, task_id):
    conn = database(data_dir)
    try:
        return conn.execute(
            "SELECT created_at FROM task_events WHERE task_id = ? AND type = ?",
            (task_id, "response.in_progress"),
        ).fetchone()[0]
    finally:
        conn.close()


def test_one_callers_backlog_does_not_starve_another(lmsp_data):
    with ServerProcess(lmsp_data, max_batch_size=1, **SLOW) as server:
        c = pair(server, "busy", WRITER)
        with bearer(server, c["access_token"]) as client, server.client() as owner:
            body = {"input": "hi", "background": True, "max_output_tokens": 25, "temperature": 0}
            backlog = [client.post("/responses", json=body).json() for _ in range(6)]
            wait_task(owner, backlog[0]["task_id"], lambda t: t["state"] == "running")
            mine = owner.post("/responses", json=body).json()
            for r in [*backlog, mine]:
                assert wait_task(owner, r["task_id"], timeout=300)["state"] == "completed"
        starts = {r["id"]: _started_at(lmsp_data, r["task_id"]) for r in [*backlog, mine]}
    # One slot: the backlog's running task, then at most one more of it, then the owner's.
    later = [r for r in backlog if starts[r["id"]] > starts[mine["id"]]]
    assert len(later) >= 4, starts


def test_a_caller_holding_every_slot_yields_one(lmsp_data):
    """Two slots, both taken by one client's long generations: the owner's task starts within
    a step or two (one of them is paused), and the paused one resumes to the same text."""
    with ServerProcess(lmsp_data, max_batch_size=2, **SLOW) as server:
        c = pair(server, "hog", WRITER)
        with bearer(server, c["access_token"]) as client, server.client() as owner:
            long = {"input": "Tell", "background": True, "max_output_tokens": 600}
            hogs = [
                client.post("/responses", json={**long, "temperature": 0}).json() for _ in range(2)
            ]
            for r in hogs:
                wait_task(owner, r["task_id"], lambda t: t["state"] == "running", timeout=60)
            asked = time.monotonic()
            mine = owner.post("/responses", json={**long, "max_output_tokens": 5}).json()
            wait_task(owner, mine["task_id"], lambda t: t["state"] != "queued", timeout=120)
            waited = time.monotonic() - asked
            assert waited < 4.0, waited
            assert wait_task(owner, mine["task_id"])["state"] == "completed"
            texts = []
            for r in hogs:
                assert wait_task(owner, r["task_id"], timeout=300)["state"] == "completed"
                log = events(owner, r["task_id"])
                assert [e["sequence_number"] for e in log] == list(range(len(log)))
                done = owner.get(f"/responses/{r['id']}").json()
                assert done["status"] == "incomplete" and done["usage"]["output_tokens"] == 600
                texts.append(done["output"][0]["content"][0]["text"])
                deltas = "".join(e["delta"] for e in log if e["type"].endswith("text.delta"))
                assert deltas == texts[-1]
            assert texts[0] == texts[1]  # greedy, same prompt: the paused one lost nothing


def test_the_input_is_stored_once(lmsp_data):
    marker = "unique-marker-" + "x" * 200
    with ServerProcess(lmsp_data) as server, server.client() as owner:
        r = owner.post(
            "/responses",
            json={"input": marker, "max_output_tokens": 1, "instructions": "Be brief."},
            headers={"Idempotency-Key": "stored-once"},
        )
        assert r.status_code == 200, r.text
        items = owner.get(f"/responses/{r.json()['id']}/input_items").json()["data"]
        assert items[0]["content"][0]["text"] == marker
        follow = owner.post(
            "/responses",
            json={"input": "and?", "max_output_tokens": 1, "previous_response_id": r.json()["id"]},
        )
        assert follow.status_code == 200
        conn = sqlite3.connect(lmsp_data / "lmsp.sqlite")
        try:
            copies = 0
            for table, column in (
                ("responses", "request"),
                ("responses", "output"),
                ("tasks", "params"),
                ("tasks", "snapshot"),
                ("task_events", "data"),
                ("idempotency_keys", "body"),
            ):
                for (value,) in conn.execute(f"SELECT {column} FROM {table}"):
                    copies += (value or "").count(marker)
        finally:
            conn.close()
    # Once for the first request, once more as the follow-up's earlier turn: never four times.
    assert copies == 2, copies


def test_the_context_window_is_read_again_when_the_config_changes(tmp_path):
    from jupyter_lmsp.engine.tokens import context_window

    config = tmp_path / "config.json"
    assert context_window(str(tmp_path)) is None  # no config
    config.write_text('{"max_position_embeddings": 100}')
    assert context_window(str(tmp_path)) == 100
    assert context_window(str(tmp_path)) == 100
    config.write_text('{"text_config": {"max_position_embeddings": 4096}}')
    assert context_window(str(tmp_path)) == 4096
    config.write_text("not json")
    assert context_window(str(tmp_path)) is None
