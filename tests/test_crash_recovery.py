"""Crash tests: a real `jupyter server` subprocess killed with SIGKILL before, during and after
generation, then started again on the same database. Every task must end as the 11.3 table
says, every event log must stay contiguous from 0 with one terminal event, and a `resume` task
must continue where its last commit left off, giving the text an uninterrupted run gives. The
queued-task and resume crashes run on SQLite and on PostgreSQL."""

from __future__ import annotations

import json
import time

import pytest
from serverproc import ServerProcess, with_test_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TERMINAL = {"response.completed", "response.incomplete", "response.failed", "response.cancelled"}
SLOW = {"engine_token_delay": 0.05, "snapshot_interval": 0.02}


def create(client, **body):
    body = {"input": "Tell me a story about a robot.", "background": True, **body}
    r = client.post("/responses", json=body)
    assert r.status_code == 202, r.text
    return r.json()


def events(client, task_id):
    r = client.get(f"/tasks/{task_id}/events", params={"limit": 1000})
    assert r.status_code == 200
    page = r.json()
    assert not page["has_more"]
    return page["data"]


def wait_for(client, task_id, predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        task = client.get(f"/tasks/{task_id}").json()
        log = events(client, task_id)
        if predicate(task, log):
            return task, log
        time.sleep(0.05)
    raise AssertionError(f"{task_id} never satisfied the condition: {task}")


def deltas(log):
    return [e for e in log if e["type"] == "response.output_text.delta"]


def finished(task, _log):
    return task["state"] in ("completed", "failed", "cancelled")


def check_log(log):
    assert [e["sequence_number"] for e in log] == list(range(len(log)))
    assert log[0]["type"] == "response.created"
    assert sum(e["type"] in TERMINAL for e in log) == 1
    assert log[-1]["type"] in TERMINAL
    return log[-1]


def read_sse(server, path, last_event_id):
    """Reconnect to a stream as an SSE client would, with Last-Event-ID."""
    with (
        server.client() as c,
        c.stream(
            "GET",
            path,
            headers={"Accept": "text/event-stream", "Last-Event-ID": str(last_event_id)},
        ) as r,
    ):
        assert r.status_code == 200
        out = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.append(json.loads(line[6:]))
        return out


@pytest.fixture(params=["sqlite", "postgresql"])
def backend(request):
    """The server's database: its data folder's SQLite file, or a PostgreSQL database."""
    if request.param == "sqlite":
        return {}
    return {"db_url": request.getfixturevalue("pg_url")}


def test_kill_before_generation_queued_tasks(lmsp_data, backend):
    # One generation at a time, so the later tasks are still queued when the server dies.
    server = ServerProcess(lmsp_data, max_batch_size=1, **SLOW, **backend).start()
    with server.client() as c:
        busy = create(c, max_output_tokens=400, temperature=0, on_restart="fail")
        wait_for(c, busy["task_id"], lambda t, log: len(deltas(log)) >= 2)
        # Greedy: sampled at random, the test model may end (EOS) within 8 tokens, and the
        # runs after the restart would be `completed` rather than `incomplete`.
        queued = {
            p: create(c, max_output_tokens=8, temperature=0, on_restart=p)
            for p in ("fail", "retry", "resume")
        }
        for resp in queued.values():
            assert c.get(f"/tasks/{resp['task_id']}").json()["state"] == "queued"
    server.kill()

    with (
        ServerProcess(lmsp_data, **backend).start() as server2,
        server2.client() as c,
    ):
        task, log = wait_for(c, busy["task_id"], finished)
        assert task["state"] == "failed"
        assert task["error"]["code"] == "server_restarted"
        last = check_log(log)
        assert last["type"] == "response.failed"
        assert last["response"]["error"]["code"] == "server_restarted"

        task, log = wait_for(c, queued["fail"]["task_id"], finished)
        assert task["state"] == "failed" and check_log(log)["type"] == "response.failed"
        assert [e["type"] for e in log] == ["response.created", "response.failed"]
        for policy in ("retry", "resume"):
            task, log = wait_for(c, queued[policy]["task_id"], finished)
            assert task["state"] == "completed", policy
            assert check_log(log)["type"] == "response.incomplete"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, test_model_dir):
    """`run(request)`: the request's text, output tokens and last event type when it runs
    uninterrupted, on a SQLite server of its own started for it. Made once per request: the
    SQLite and PostgreSQL cases of a temperature compare against the same run (it was made
    twice, one server start each)."""
    made: dict[str, tuple[str, int, str]] = {}

    def run(request):
        key = json.dumps(request, sort_keys=True)
        if key not in made:
            data = with_test_model(tmp_path_factory.mktemp("ref"), test_model_dir)
            with ServerProcess(data).start() as ref, ref.client() as c:
                reference = create(c, **request)
                _, ref_log = wait_for(c, reference["task_id"], finished)
                final = check_log(ref_log)["response"]
                made[key] = (
                    final["output"][0]["content"][0]["text"],
                    final["usage"]["output_tokens"],
                    ref_log[-1]["type"],
                )
        return made[key]

    return run


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_kill_during_generation_resume_gives_the_uninterrupted_text(
    lmsp_data, temperature, backend, uninterrupted
):
    request = {
        "max_output_tokens": 120,
        "temperature": temperature,
        "seed": 1234,
        "on_restart": "resume",
    }
    # The reference: the same request, uninterrupted, on a server of its own.
    expected_text, expected_tokens, expected_end = uninterrupted(request)

    server = ServerProcess(lmsp_data, **SLOW, **backend).start()
    with server.client() as c:
        resp = create(c, **request)
        _, seen = wait_for(c, resp["task_id"], lambda t, log: len(deltas(log)) >= 15)
    server.kill()
    seen_until = seen[-1]["sequence_number"]

    with (
        ServerProcess(lmsp_data, **backend).start() as server2,
        server2.client() as c,
    ):
        rest = read_sse(server2, f"/tasks/{resp['task_id']}/events", seen_until)
        whole = seen + rest
        check_log(whole)
        assert whole[-1]["type"] == expected_end
        text = "".join(e["delta"] for e in deltas(whole))
        assert text == expected_text
        final = whole[-1]["response"]
        assert final["output"][0]["content"][0]["text"] == expected_text
        assert final["usage"]["output_tokens"] == expected_tokens
        # What a late reader gets from the database is the same unbroken log.
        assert events(c, resp["task_id"]) == whole


@pytest.mark.parametrize("policy", ["fail", "retry"])
def test_kill_during_generation_fail_and_retry(lmsp_data, policy):
    server = ServerProcess(lmsp_data, **SLOW).start()
    with server.client() as c:
        resp = create(c, max_output_tokens=60, temperature=0, on_restart=policy)
        wait_for(c, resp["task_id"], lambda t, log: len(deltas(log)) >= 5)
    server.kill()
    with ServerProcess(lmsp_data).start() as server2, server2.client() as c:
        task, log = wait_for(c, resp["task_id"], finished)
        last = check_log(log)
        if policy == "fail":
            assert task["state"] == "failed" and last["type"] == "response.failed"
            assert last["response"]["error"]["code"] == "server_restarted"
        else:
            assert task["state"] == "completed"
            types = [e["type"] for e in log]
            # the interrupted attempt's message is closed, the task queued again, then rerun
            assert "response.queued" in types
            assert types.count("response.output_item.added") == 2
            final = last["response"]
            assert len(final["output"]) == 1
            assert final["usage"]["output_tokens"] == 60


def test_kill_while_cancelling(lmsp_data):
    server = ServerProcess(lmsp_data, engine_token_delay=1.0).start()
    with server.client() as c:
        resp = create(c, max_output_tokens=50, on_restart="resume")
        wait_for(c, resp["task_id"], lambda t, log: t["state"] == "running")
        state = c.post(f"/tasks/{resp['task_id']}/cancel").json()["state"]
        server.kill()
    assert state == "cancelling"
    with ServerProcess(lmsp_data).start() as server2, server2.client() as c:
        task, log = wait_for(c, resp["task_id"], finished)
        assert task["state"] == "cancelled"
        assert check_log(log)["type"] == "response.cancelled"


def test_kill_after_generation_leaves_finished_tasks_alone(lmsp_data):
    server = ServerProcess(lmsp_data).start()
    with server.client() as c:
        done = create(c, max_output_tokens=10, on_restart="fail")
        _, before = wait_for(c, done["task_id"], finished)
    server.kill()
    with ServerProcess(lmsp_data).start() as server2, server2.client() as c:
        task = c.get(f"/tasks/{done['task_id']}").json()
        assert task["state"] == "completed"
        assert events(c, done["task_id"]) == before
        check_log(before)


def test_a_started_server_entered_as_a_context_is_not_started_again(lmsp_data):
    """`with ServerProcess(...).start() as server:` (as the tests above write it) runs one
    server, and stops it on the way out; it used to start a second one and leak the first."""
    server = ServerProcess(lmsp_data).start()
    first = server.proc
    with server as same:
        assert same.proc is first and same.running
    assert first is not None and first.poll() is not None
