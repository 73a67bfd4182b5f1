"""Prometheus metrics (issue 18) on a real server: a scripted workload, then `/lmsp/v1/metrics`
and Jupyter Server's `/metrics` read with `prometheus_client`'s text parser, each counter
checked against what the workload did (exact values); who may read them; what a kill -9 and a
restart with one task per restart policy leave in the recovery metrics."""

from __future__ import annotations

import json
import os
import signal
import sqlite3

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from securityhelpers import bearer, pair, wait_task
from serverproc import TOKEN, ServerProcess, http_client

from jupyter_lmsp.models.testmodel import CONFIG

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MODEL = "tiny"
BASE = {"temperature": 0, "max_output_tokens": 6}


def scrape(text: str) -> dict[tuple[str, frozenset], float]:
    """Every sample of an exposition: (name, labels) → value."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def lmsp_metrics(server) -> dict[tuple[str, frozenset], float]:
    with server.client() as c:
        r = c.get("/metrics")
        assert r.status_code == 200, r.text
        assert r.headers["Content-Type"].startswith("text/plain")
        return scrape(r.text)


def jupyter_metrics(server) -> dict[tuple[str, frozenset], float]:
    r = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"token {TOKEN}"})
    assert r.status_code == 200, r.text
    return scrape(r.text)


def value(samples, name: str, **labels: str) -> float:
    """A sample's value; 0 when it was never recorded (a counter never incremented)."""
    return samples.get((name, frozenset(labels.items())), 0.0)


def usage_of(c: httpx.Client, response_id: str) -> dict:
    return c.get(f"/responses/{response_id}").json()["usage"]


def sse_data(lines) -> list[dict]:
    return [json.loads(line[6:]) for line in lines if line.startswith("data: ")]


def test_scripted_workload_counts_exactly(lmsp_data):
    with ServerProcess(lmsp_data, engine_token_delay=0.02, snapshot_interval=0.02) as server:
        responses = []  # ids of every response the workload created
        with server.client() as c:
            # A plain response.
            plain = c.post("/responses", json={"input": "Plain one.", **BASE})
            assert plain.status_code == 200, plain.text
            responses.append(plain.json()["id"])
            # A streamed one.
            with c.stream(
                "POST", "/responses", json={"input": "Streamed one.", "stream": True, **BASE}
            ) as r:
                assert r.status_code == 200
                streamed = sse_data(r.iter_lines())
            responses.append(streamed[0]["response"]["id"])
            # A background one, followed to its end.
            bg = c.post("/responses", json={"input": "Background.", "background": True, **BASE})
            assert bg.status_code == 202
            wait_task(c, bg.json()["task_id"])
            responses.append(bg.json()["id"])
            # One cancelled while it generates.
            long = c.post(
                "/responses",
                json={"input": "A long one.", "background": True, **BASE, "max_output_tokens": 400},
            ).json()
            wait_task(c, long["task_id"], lambda t: t["last_sequence_number"] >= 6)
            assert c.post(f"/responses/{long['id']}/cancel").status_code == 200
            assert wait_task(c, long["task_id"])["state"] == "cancelled"
            responses.append(long["id"])
            # An idempotent request, replayed, then its key reused for another request.
            keyed = {"input": "Keyed.", "background": True, **BASE}
            key = {"Idempotency-Key": "metrics-key-1"}
            first = c.post("/responses", json=keyed, headers=key)
            again = c.post("/responses", json=keyed, headers=key)
            assert first.status_code == again.status_code == 202
            assert again.headers["Idempotent-Replayed"] == "true"
            other = c.post("/responses", json={**keyed, "input": "Other."}, headers=key)
            assert other.status_code == 422
            wait_task(c, first.json()["task_id"])
            responses.append(first.json()["id"])
            # The SDK retrying a create without a key (its retry count header).
            retried = c.post(
                "/responses",
                json={"input": "Retried.", **BASE},
                headers={"x-stainless-retry-count": "1"},
            )
            assert retried.status_code == 200
            responses.append(retried.json()["id"])

            # An SSE reconnect on the finished background task: what it replays is known.
            before = lmsp_metrics(server)
            task_id = bg.json()["task_id"]
            with c.stream(
                "GET",
                f"/tasks/{task_id}/events",
                headers={"Accept": "text/event-stream", "Last-Event-ID": "2"},
            ) as r:
                replayed = sse_data(r.iter_lines())
            assert replayed[0]["sequence_number"] == 3
            after = lmsp_metrics(server)
            assert (
                value(after, "lmsp_sse_reconnects_total")
                - value(before, "lmsp_sse_reconnects_total")
                == 1
            )
            assert value(after, "lmsp_sse_events_replayed_total") - value(
                before, "lmsp_sse_events_replayed_total"
            ) == len(replayed)
            assert value(after, "lmsp_sse_streams_open") == 0

            usages = [usage_of(c, rid) for rid in responses]

        # Refused callers: no credentials, an unknown token, a wrong XSRF-less POST.
        with http_client(base_url=server.api, timeout=30) as anon:
            assert anon.get("/models").status_code == 401
            unknown = {"Authorization": "Bearer lmsp_" + "A" * 43}
            assert anon.get("/tasks", headers=unknown).status_code == 401
        # Pairing: one approved (through the whole flow), one denied.
        token = pair(server, "metrics-reader", ["metrics:read"])
        with (
            http_client(base_url=server.api, timeout=30) as anon,
            server.client() as own,
        ):
            started = anon.post("/pairings", json={"client_name": "no", "scopes": ["tasks:read"]})
            assert own.post(f"/pairings/{started.json()['id']}/deny").status_code == 200

        with bearer(server, token["access_token"]) as reader:
            r = reader.get("/metrics")
            assert r.status_code == 200
            m = scrape(r.text)
        served_by_jupyter = jupyter_metrics(server)

    n = len(responses)
    assert value(m, "lmsp_tasks_created_total", kind="response", model=MODEL) == n
    assert value(m, "lmsp_tasks_ended_total", model=MODEL, state="completed") == n - 1
    assert value(m, "lmsp_tasks_ended_total", model=MODEL, state="cancelled") == 1
    assert value(m, "lmsp_tasks", state="completed") == n - 1
    assert value(m, "lmsp_tasks", state="cancelled") == 1
    assert value(m, "lmsp_tasks", state="queued") == 0
    # Requests by operation and status.
    http = "lmsp_http_requests_total"
    assert value(m, http, operation="createResponse", method="POST", status="200") == 3
    assert value(m, http, operation="createResponse", method="POST", status="202") == 4
    assert value(m, http, operation="createResponse", method="POST", status="422") == 1
    assert value(m, http, operation="cancelResponse", method="POST", status="200") == 1
    assert value(m, http, operation="listModels", method="GET", status="401") == 1
    assert value(m, http, operation="listTasks", method="GET", status="401") == 1
    assert value(m, http, operation="startPairing", method="POST", status="201") == 2
    # Idempotency and retries.
    idem = "lmsp_idempotent_requests_total"
    assert value(m, idem, operation="createResponse", outcome="new") == 1
    assert value(m, idem, operation="createResponse", outcome="replayed") == 1
    assert value(m, idem, operation="createResponse", outcome="mismatch") == 1
    assert value(m, idem, operation="createResponse", outcome="conflict") == 0
    assert value(m, "lmsp_unkeyed_retries_total", operation="createResponse") == 1
    # Each generation's latencies were observed once; tokens in and out are the usage's.
    for name in ("lmsp_queue_wait_seconds", "lmsp_time_to_first_token_seconds"):
        assert value(m, f"{name}_count", model=MODEL) == n, name
    duration = "lmsp_task_duration_seconds_count"
    assert value(m, duration, model=MODEL, state="completed") == n - 1
    assert value(m, duration, model=MODEL, state="cancelled") == 1
    assert value(m, "lmsp_input_tokens_total", model=MODEL) == sum(
        u["input_tokens"] for u in usages
    )
    outputs = sum(u["output_tokens"] for u in usages)
    assert value(m, "lmsp_output_tokens_total", model=MODEL) == outputs
    # Every token but each generation's first followed a gap.
    assert value(m, "lmsp_inter_token_latency_seconds_count", model=MODEL) == outputs - n
    cached = [u["input_tokens_details"]["cached_tokens"] for u in usages]
    assert value(m, "lmsp_prompt_cache_lookups_total", model=MODEL) == n
    assert value(m, "lmsp_prompt_cache_hits_total", model=MODEL) == sum(1 for x in cached if x)
    assert value(m, "lmsp_prompt_cache_reused_tokens_total", model=MODEL) == sum(cached)
    # Keys and values of every layer for each reused position (the test model is float32).
    per_position = (
        CONFIG["num_hidden_layers"]
        * 2
        * CONFIG["num_key_value_heads"]
        * (CONFIG["hidden_size"] // CONFIG["num_attention_heads"])
        * 4
    )
    reused_bytes = value(m, "lmsp_prompt_cache_reused_bytes_total", model=MODEL)
    assert reused_bytes == sum(cached) * per_position
    assert value(m, "lmsp_prompt_cache_bytes") > 0
    assert value(m, "lmsp_model_loads_total", model=MODEL) == 1
    assert value(m, "lmsp_model_load_seconds_count", model=MODEL) == 1
    assert value(m, "lmsp_worker_restarts_total") == 0
    # Every decode step was reported with its batch size: each row of a step is one token.
    steps = value(m, "lmsp_batch_size_count")
    assert steps >= outputs / 8 and value(m, "lmsp_batch_size_sum") >= outputs - n
    assert value(m, "lmsp_snapshot_commit_lag_seconds_count") >= n
    assert value(m, "lmsp_runner_transaction_seconds_count", job="append_outputs") >= n
    assert value(m, "lmsp_runner_transaction_seconds_count", job="start_running") == n
    # Auth.
    assert value(m, "lmsp_pairing_requests_total") == 2
    assert value(m, "lmsp_pairing_decisions_total", decision="approved") == 1
    assert value(m, "lmsp_pairing_decisions_total", decision="denied") == 1
    assert value(m, "lmsp_refused_requests_total", status="401", reason="invalid_token") == 2
    # Nothing was recovered: the server started on an empty database.
    assert not [k for k in m if k[0] == "lmsp_recovered_tasks_total"]
    # Jupyter Server's /metrics holds the same LMSP metrics (read after: the same values, but
    # for this last request's own count and duration).
    for key, v in m.items():
        if key[0].startswith("lmsp_http_request") or key[0] == "lmsp_tasks":
            continue
        if key[0].startswith("lmsp_"):
            assert served_by_jupyter.get(key) == v, key


def test_who_may_read_the_metrics(lmsp_data):
    # Three pairing starts allowed from one address, and hardly any more after them.
    with ServerProcess(lmsp_data, pairing_burst=3, pairing_rate_per_minute=0.01) as server:
        reader = pair(server, "reader", ["metrics:read"])
        other = pair(server, "other", ["tasks:read", "models:read"])
        revoked = pair(server, "revoked", ["metrics:read"])
        with server.client() as own:
            assert own.delete(f"/clients/{revoked['client_id']}").status_code == 200
            assert own.get("/metrics").status_code == 200  # the owner holds every scope
        with http_client(base_url=server.api, timeout=30) as anon:
            r = anon.get("/metrics")
            assert r.status_code == 401 and r.headers["WWW-Authenticate"].startswith("Bearer")
            assert "lmsp_" not in r.text
            # A fourth pairing start from this address is rate-limited.
            limited = anon.post("/pairings", json={"client_name": "x", "scopes": ["tasks:read"]})
            assert limited.status_code == 429
        for token in (other, revoked):
            with bearer(server, token["access_token"]) as c:
                r = c.get("/metrics")
                assert "lmsp_" not in r.text
                if token is other:
                    assert r.status_code == 403
                    assert r.json()["error"]["code"] == "insufficient_scope"
                    assert "metrics:read" in r.headers["WWW-Authenticate"]
                else:
                    assert r.status_code == 401
        with bearer(server, reader["access_token"]) as c:
            r = c.get("/metrics")
            assert r.status_code == 200 and "lmsp_tasks_created_total" in r.text
            # Only LMSP's metrics: not Jupyter Server's own, nor the process's.
            names = {f.name for f in text_string_to_metric_families(r.text)}
            assert names and all(name.startswith("lmsp_") for name in names)
        # Jupyter's /metrics asks for Jupyter's credentials (authenticate_prometheus).
        assert httpx.get(f"{server.url}/metrics").status_code == 403
        m = lmsp_metrics(server)
        assert value(m, "lmsp_refused_requests_total", status="401", reason="invalid_token") == 2
        refused = "lmsp_refused_requests_total"
        assert value(m, refused, status="403", reason="insufficient_scope") == 1
        assert value(m, refused, status="429", reason="rate_limit_exceeded") == 1
        assert value(m, "lmsp_pairing_requests_total") == 3
        assert value(m, "lmsp_pairing_decisions_total", decision="approved") == 3


def test_recovery_metrics_after_kill_and_restart(lmsp_data):
    # One generation at a time and slow tokens: the busy task is running and the others
    # queued when the server dies.
    server = ServerProcess(lmsp_data, max_batch_size=1, engine_token_delay=0.05).start()
    with server.client() as c:
        busy = c.post(
            "/responses",
            json={
                "input": "Long.",
                "background": True,
                "temperature": 0,
                "max_output_tokens": 400,
                "on_restart": "resume",
            },
        ).json()
        wait_task(c, busy["task_id"], lambda t: t["last_sequence_number"] >= 8)
        for policy in ("fail", "retry", "resume"):
            r = c.post(
                "/responses",
                json={"input": policy, "background": True, **BASE, "on_restart": policy},
            )
            assert r.json()["status"] == "queued"
    server.kill()
    with sqlite3.connect(lmsp_data / "lmsp.sqlite") as db:
        (snapshot,) = db.execute(
            "SELECT snapshot FROM tasks WHERE id = ?", (busy["task_id"],)
        ).fetchone()
    committed_tokens = len(json.loads(snapshot)["token_ids"])
    assert committed_tokens > 0

    with ServerProcess(lmsp_data, engine_token_delay=0.0) as server2, server2.client() as c:
        wait_task(c, busy["task_id"])
        m = lmsp_metrics(server2)
    recovered = "lmsp_recovered_tasks_total"
    found = {
        (dict(k[1])["previous_state"], dict(k[1])["policy"], dict(k[1])["outcome"]): v
        for k, v in m.items()
        if k[0] == recovered and dict(k[1])["cause"] == "startup"
    }
    assert found == {
        ("running", "resume", "running"): 1,
        ("queued", "fail", "failed"): 1,
        ("queued", "retry", "queued"): 1,
        ("queued", "resume", "queued"): 1,
    }
    # The resumed task's committed tokens were fed to the worker again, once.
    assert value(m, "lmsp_resumed_tokens_total", model=MODEL) == committed_tokens
    assert value(m, "lmsp_tasks", state="failed") == 1


def test_worker_restart_is_counted(lmsp_data):
    long = {"input": "Long.", "background": True, "temperature": 0, "max_output_tokens": 200}
    with ServerProcess(lmsp_data, engine_token_delay=0.05) as server, server.client() as c:
        retried = c.post("/responses", json={**long, "on_restart": "retry"}).json()
        failed = c.post("/responses", json={**long, "on_restart": "fail"}).json()
        for r in (retried, failed):
            wait_task(c, r["task_id"], lambda t: t["last_sequence_number"] >= 6)
        pid = c.get("/service").json()["worker"]["pid"]
        os.kill(pid, signal.SIGKILL)
        assert wait_task(c, failed["task_id"])["state"] == "failed"
        assert wait_task(c, retried["task_id"])["state"] == "completed"
        m = lmsp_metrics(server)
    assert value(m, "lmsp_worker_restarts_total") == 1
    recovered = "lmsp_recovered_tasks_total"
    for policy, outcome in (("retry", "queued"), ("fail", "failed")):
        labels = {"previous_state": "running", "policy": policy, "outcome": outcome}
        assert value(m, recovered, cause="worker_exit", **labels) == 1
    assert value(m, "lmsp_tasks_ended_total", model=MODEL, state="failed") == 1
    assert value(m, "lmsp_tasks_ended_total", model=MODEL, state="completed") == 1
    assert value(m, "lmsp_tasks", state="failed") == 1


def test_metrics_off_records_nothing(lmsp_data):
    """`LMSPExtension.metrics = False` (the benchmark's baseline): the endpoint still answers,
    every LMSP metric stays at zero."""
    with ServerProcess(lmsp_data, metrics=False) as server, server.client() as c:
        r = c.post("/responses", json={"input": "Off.", **BASE})
        assert r.status_code == 200
        m = lmsp_metrics(server)
    recorded = {k: v for k, v in m.items() if v and not k[0].endswith("_created")}
    assert recorded == {}
