"""Idempotency keys (LMSP B8) on a real server: replay, mismatch, concurrent duplicates,
expiry, and a SIGKILL between the commit and the reply followed by a retry with the same key."""

from __future__ import annotations

import json
import sqlite3
import threading
import time

import httpx
import pytest
from serverproc import ServerProcess, with_test_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def shared_dir(tmp_path_factory, test_model_dir):
    path = tmp_path_factory.mktemp("idem")
    return with_test_model(path, test_model_dir)


@pytest.fixture(scope="module")
def server(shared_dir):
    with ServerProcess(shared_dir, idempotency_ttl=2.0) as server:
        # A first request loads the model's tokenizer (to count prompts): done here, so the
        # tests' requests take less than the 2 s a key lives.
        with server.client() as c:
            assert c.post("/responses", json={"input": "warm", "max_output_tokens": 1}).is_success
        yield server


def task_count(lmsp_data) -> int:
    with sqlite3.connect(lmsp_data / "lmsp.sqlite") as conn:
        return conn.execute("select count(*) from tasks").fetchone()[0]


def tasks_for_input(lmsp_data, text) -> int:
    with sqlite3.connect(lmsp_data / "lmsp.sqlite") as conn:
        return conn.execute(
            "select count(*) from responses"
            " where json_extract(request, '$.conversation[#-1].content') = ?",
            (text,),
        ).fetchone()[0]


BODY = {"input": "Hello", "background": True, "max_output_tokens": 4}


def test_replay_returns_the_first_result_and_starts_nothing(server, shared_dir):
    body = {**BODY, "input": "replay"}
    with server.client() as c:
        first = c.post("/responses", json=body, headers={"Idempotency-Key": "k-1"})
        assert first.status_code == 202
        assert "Idempotent-Replayed" not in first.headers
        # Same request, keys in another order: the canonical body is the same.
        again = c.post(
            "/responses",
            content=json.dumps(dict(reversed(list(body.items())))),
            headers={"Idempotency-Key": "k-1", "Content-Type": "application/json"},
        )
        assert again.status_code == 202
        assert again.headers["Idempotent-Replayed"] == "true"
        assert again.json() == first.json()
        assert again.headers["Location"] == first.headers["Location"]
        assert tasks_for_input(shared_dir, "replay") == 1


def test_same_key_different_request_is_422(server):
    with server.client() as c:
        assert (
            c.post("/responses", json=BODY, headers={"Idempotency-Key": "k-2"}).status_code == 202
        )
        other = c.post(
            "/responses", json={**BODY, "input": "Bye"}, headers={"Idempotency-Key": "k-2"}
        )
        assert other.status_code == 422
        assert other.json()["error"]["code"] == "idempotency_key_mismatch"


def test_errors_are_replayed_too(server):
    with server.client() as c:
        bad = {"input": 42}
        first = c.post("/responses", json=bad, headers={"Idempotency-Key": "k-bad"})
        again = c.post("/responses", json=bad, headers={"Idempotency-Key": "k-bad"})
        assert first.status_code == again.status_code == 400
        assert again.json() == first.json()
        assert again.headers["Idempotent-Replayed"] == "true"


def test_invalid_keys_are_refused(server):
    with server.client() as c:
        for key in (b"", b"has space", b"x" * 256, "é".encode()):
            r = c.post("/responses", json=BODY, headers={"Idempotency-Key": key})
            assert r.status_code == 400, key
            assert r.json()["error"]["code"] == "invalid_idempotency_key"


def test_concurrent_duplicates_start_one_task(server, shared_dir):
    body = {**BODY, "input": "race"}
    results: list[httpx.Response] = []
    barrier = threading.Barrier(8)

    def send() -> None:
        with server.client() as c:
            barrier.wait()
            results.append(c.post("/responses", json=body, headers={"Idempotency-Key": "k-race"}))

    threads = [threading.Thread(target=send) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    statuses = sorted(r.status_code for r in results)
    assert set(statuses) <= {202, 409}
    accepted = [r for r in results if r.status_code == 202]
    assert accepted and len({r.json()["id"] for r in accepted}) == 1
    for r in results:
        if r.status_code == 409:
            assert r.json()["error"]["code"] == "idempotency_key_in_use"
            assert int(r.headers["Retry-After"]) >= 1
    assert tasks_for_input(shared_dir, "race") == 1


def test_duplicate_while_a_plain_request_is_generating_is_409(lmsp_data):
    with ServerProcess(lmsp_data, engine_token_delay=0.05) as server:
        body = {"input": "Long", "max_output_tokens": 60, "temperature": 0}
        first: list[httpx.Response] = []
        with server.client() as c:
            t = threading.Thread(
                target=lambda: first.append(
                    c.post("/responses", json=body, headers={"Idempotency-Key": "k-plain"})
                )
            )
            t.start()
            # Once its task runs (60 tokens, 50 ms each), the first request is generating.
            deadline = time.monotonic() + 60
            while not c.get("/tasks", params={"state": "running"}).json()["data"]:
                assert time.monotonic() < deadline, "the first request never started"
                time.sleep(0.02)
            with server.client() as c2:
                second = c2.post("/responses", json=body, headers={"Idempotency-Key": "k-plain"})
            assert second.status_code == 409
            assert second.json()["error"]["code"] == "idempotency_key_in_use"
            assert "Retry-After" in second.headers
            t.join()
            assert first[0].status_code == 200
            third = c.post("/responses", json=body, headers={"Idempotency-Key": "k-plain"})
            assert third.status_code == 200
            assert third.headers["Idempotent-Replayed"] == "true"
            assert third.json() == first[0].json()
        assert task_count(lmsp_data) == 1


def test_keys_expire(server):
    with server.client() as c:
        first = c.post("/responses", json=BODY, headers={"Idempotency-Key": "k-exp"})
        time.sleep(2.5)
        later = c.post(
            "/responses", json={**BODY, "input": "x"}, headers={"Idempotency-Key": "k-exp"}
        )
        assert later.status_code == 202
        assert later.json()["id"] != first.json()["id"]
        assert "Idempotent-Replayed" not in later.headers


def test_kill_between_commit_and_reply_then_retry_returns_the_original_task(lmsp_data):
    crashing = ServerProcess(lmsp_data, env={"LMSP_FAILPOINTS": "after_create_commit"}).start()
    with crashing.client() as c, pytest.raises(httpx.TransportError):
        c.post("/responses", json=BODY, headers={"Idempotency-Key": "k-crash"})
    crashing.proc.wait(10)
    assert crashing.proc.returncode == -9
    assert task_count(lmsp_data) == 1  # the work was committed before the process died

    with ServerProcess(lmsp_data) as server, server.client() as c:
        retry = c.post("/responses", json=BODY, headers={"Idempotency-Key": "k-crash"})
        assert retry.status_code == 202
        assert retry.headers["Idempotent-Replayed"] == "true"
        with sqlite3.connect(lmsp_data / "lmsp.sqlite") as conn:
            (task_id,) = conn.execute("select id from tasks").fetchone()
        assert retry.json()["task_id"] == task_id
        assert task_count(lmsp_data) == 1
