"""Webhooks end to end (issue 38): a real `jupyter server` subprocess, a real receiver on
loopback (tests/webhookreceiver.py: signatures checked with `standardwebhooks` and the openai
SDK's `webhooks.unwrap`).

- Never lost: 100 background responses (incomplete, cancelled, and one failed by its restart
  policy) while the receiver refuses every first attempt, and the service is killed
  with SIGKILL twice while a delivery is in flight (from inside the receiver, before it
  answers). After the restarts, every terminal event arrived, and exactly one webhook-id per
  response, of the type its final status says; the deliveries cut short by the kills came
  again with their same webhook-id.
- Dead and hanging receivers: a refused port's deliveries become dead letters after the
  configured attempts (`GET …/deliveries?status=dead`), while a receiver that never answers
  holds only its own deliveries: a live endpoint gets its events and a foreground response
  completes meanwhile. A dead letter redelivered (after pointing its endpoint at a live
  receiver) arrives with its original webhook-id.
- The API: owner only (a paired client gets 403 `owner_only`), the secret shown once, no
  `Idempotency-Key` on creation, bad input as 400s naming the field, 404s.
"""

from __future__ import annotations

import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from serverproc import ServerProcess, http_client
from webhookreceiver import Receiver

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

EVENTS = ["response.completed", "response.failed", "response.cancelled", "response.incomplete"]
FAST_RETRIES = {
    "webhook_backoff": 0.02,
    "webhook_backoff_max": 0.2,
    "webhook_poll_interval": 0.05,
}
TERMINAL_STATES = {"completed", "incomplete", "failed", "cancelled"}


def register(client, url, events=EVENTS):
    r = client.post("/webhooks", json={"url": url, "events": events})
    assert r.status_code == 201, r.text
    return r.json()


def create(client, **body):
    body = {"input": "Webhooks.", "background": True, "temperature": 0, **body}
    r = client.post("/responses", json=body)
    assert r.status_code == 202, r.text
    return r.json()["id"]


def deliveries(client, endpoint_id, status=None):
    params = {"limit": 100, **({"status": status} if status else {})}
    found, after = [], None
    while True:
        r = client.get(
            f"/webhooks/{endpoint_id}/deliveries",
            params={**params, **({"after": after} if after else {})},
        )
        assert r.status_code == 200, r.text
        page = r.json()
        found += page["data"]
        if not page["has_more"]:
            return found
        after = page["data"][-1]["id"]


def test_every_terminal_event_arrives_once_by_id_across_two_kills(lmsp_data):
    gate = threading.Event()  # closed: the receiver refuses everything (503)
    kills = [20, 60]  # kill the service when this many distinct ids were accepted
    killed: list[str] = []
    cut: set[tuple[str, int]] = set()  # (id, receipt) left unanswered by a kill
    stage_done = [threading.Event(), threading.Event()]
    lock = threading.Lock()
    current: dict[str, ServerProcess] = {}

    def answer(msg_id: str, n: int) -> int | None:
        if (msg_id, n) in cut:
            return None  # the service is dead: nobody to answer
        return 200 if gate.is_set() and n > 1 else 503  # every first attempt refused

    receiver = Receiver(answer)

    def before_answer(msg_id: str, _event) -> None:
        with lock:
            stage = len(killed)
            if (
                stage < len(kills)
                and gate.is_set()
                and len(receiver.accepted) >= kills[stage]
                and receiver.receipts[msg_id] > 1
            ):
                current["server"].kill()  # mid-delivery: this one is not answered
                killed.append(msg_id)
                cut.add((msg_id, receiver.receipts[msg_id]))
                stage_done[stage].set()

    receiver.before_answer = before_answer
    # Slowed a little, so the long `fail` task still runs when the service is first killed.
    options = dict(
        FAST_RETRIES,
        webhook_max_attempts=100000,
        webhook_timeout=10,
        engine_token_delay=0.02,
        webhook_concurrency=8,
        webhook_endpoint_concurrency=6,
    )
    try:
        server = current["server"] = ServerProcess(lmsp_data, **options).start()
        with server.client() as c:
            endpoint = register(c, receiver.url)
            receiver.secret = endpoint["secret"]
            # Running when the service is first killed, policy `fail`: it ends `failed`.
            doomed = create(c, max_output_tokens=100000, on_restart="fail")
            with ThreadPoolExecutor(4) as pool:
                made = list(pool.map(lambda i: create(c, max_output_tokens=2 + i % 3), range(89)))
                # Long ones cancelled at once: they end `cancelled`, queued or running.
                cancelled = list(pool.map(lambda _: create(c, max_output_tokens=4000), range(10)))
                stops = pool.map(lambda rid: c.post(f"/responses/{rid}/cancel"), cancelled)
                assert {r.status_code for r in stops} == {200}
        responses = {doomed, *made, *cancelled}
        assert len(responses) == 100
        gate.set()
        for stage in range(2):
            assert stage_done[stage].wait(120), (
                f"kill {stage + 1} never came: {len(receiver.accepted)}"
            )
            server = current["server"] = ServerProcess(lmsp_data, **options).start()
        assert receiver.wait_accepted(100, 120), len(receiver.accepted)

        with server.client() as c:
            final = {rid: c.get(f"/responses/{rid}").json() for rid in responses}
            rows = deliveries(c, endpoint["id"])
        assert {r["status"] for r in final.values()} <= TERMINAL_STATES
        by_response: dict[str, set[str]] = {}
        for msg_id, event in receiver.accepted.items():
            by_response.setdefault(event["data"]["id"], set()).add(msg_id)
            status = final[event["data"]["id"]]["status"]
            assert event["type"] == f"response.{status}", (event, status)
        assert set(by_response) == set(responses)
        assert all(len(ids) == 1 for ids in by_response.values())  # one webhook-id per end
        assert receiver.bad == []
        # The mix of ends this run made (kills fail the `fail` tasks that were running).
        seen = {e["type"] for e in receiver.accepted.values()}
        assert {"response.incomplete", "response.cancelled", "response.failed"} <= seen
        assert final[doomed]["status"] == "failed"
        # (A long one may still end first, at its end of sequence, before its cancel lands.)
        assert sum(final[rid]["status"] == "cancelled" for rid in cancelled) >= 5
        # The deliveries cut short by the kills came again, with their same webhook-id.
        assert len(killed) == 2 and all(receiver.receipts[k] >= 3 for k in killed)
        assert all(k in receiver.accepted for k in killed)
        # Every first attempt was refused; the outbox says so, and nothing is left.
        assert len(rows) == 100 and {r["status"] for r in rows} == {"delivered"}
        # (An attempt a kill cut short is not counted: the row counts the attempts recorded.)
        assert all(r["attempts"] >= 1 and r["event"]["id"] in receiver.accepted for r in rows)
    finally:
        gate.set()
        if "server" in current:
            current["server"].stop()
        receiver.close()


def refused_url() -> str:
    with socket.socket() as s:  # a port nobody listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/hook"


def pair(c, client_scopes):  # a paired client with every scope it asks for, via the API

    with http_client(base_url=str(c.base_url), timeout=30) as anon:
        started = anon.post("/pairings", json={"client_name": "hooks", "scopes": client_scopes})
        assert c.post(f"/pairings/{started.json()['id']}/approve").status_code == 200
        token = anon.post(
            f"/pairings/{started.json()['id']}/token",
            json={"device_code": started.json()["device_code"]},
        )
        return token.json()["access_token"]


def test_dead_and_hanging_receivers_and_the_api(lmsp_data):
    release = threading.Event()
    live, rescue = Receiver(), Receiver()
    hanging = Receiver(lambda _id, _n: 200)
    hanging.before_answer = lambda _id, _event: release.wait(60)
    server = ServerProcess(
        lmsp_data, **FAST_RETRIES, webhook_max_attempts=3, webhook_timeout=60
    ).start()
    try:
        with server.client() as c:
            # The API: bad input, secrets, owner only.
            for bad, param in (
                ({"url": "ftp://x/", "events": EVENTS}, "url"),
                ({"url": "http://u:p@127.0.0.1/", "events": EVENTS}, "url"),
                ({"url": live.url, "events": ["response.created"]}, "events"),
                ({"url": live.url, "events": []}, "events"),
                ({"url": live.url}, "events"),
                ({"url": live.url, "events": EVENTS, "extra": 1}, "extra"),
            ):
                r = c.post("/webhooks", json=bad)
                assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
            r = c.post(
                "/webhooks",
                json={"url": live.url, "events": EVENTS},
                headers={"Idempotency-Key": "k"},
            )
            assert r.json()["error"]["code"] == "idempotency_key_not_supported"
            on_live = register(c, live.url)
            live.secret = on_live["secret"]
            assert on_live["secret"].startswith("whsec_")
            on_hang = register(c, hanging.url)
            hanging.secret = on_hang["secret"]
            on_dead = register(c, refused_url(), ["response.completed", "response.incomplete"])
            listed = c.get("/webhooks").json()["data"]
            assert [e["id"] for e in listed] == [on_live["id"], on_hang["id"], on_dead["id"]]
            assert all("secret" not in e for e in listed)
            assert "secret" not in c.get(f"/webhooks/{on_dead['id']}").json()
            assert c.get("/webhooks/whep_nope").status_code == 404
            token = pair(c, ["responses:read", "responses:write", "clients:admin"])
            other = {"Authorization": f"Bearer {token}"}
            for method, path in (
                ("GET", "/webhooks"),
                ("POST", "/webhooks"),
                ("GET", f"/webhooks/{on_live['id']}"),
            ):
                r = c.request(method, path, headers=other, json={"url": live.url, "events": EVENTS})
                assert r.status_code == 403 and r.json()["error"]["code"] == "owner_only", r.text

            ids = []
            for i in range(3):
                r = c.post(
                    "/responses",
                    json={"input": f"hi {i}", "background": True, "max_output_tokens": 3},
                )
                ids.append(r.json()["id"])
            # The live endpoint gets every end while the hanging one holds its deliveries...
            assert live.wait_accepted(3, 60)
            assert {e["data"]["id"] for e in live.accepted.values()} == set(ids)
            # ...the refused port's become dead letters after 3 attempts...
            for _ in range(600):
                dead = deliveries(c, on_dead["id"], "dead")
                if len(dead) == 3:
                    break
                live.wait_accepted(10**6, 0.05)
            assert len(dead) == 3 and {d["attempts"] for d in dead} == {3}
            assert all(d["last_status_code"] is None and d["last_error"] for d in dead)
            # ...and a foreground response is answered meanwhile.
            r = c.post("/responses", json={"input": "now", "max_output_tokens": 3})
            assert r.status_code == 200 and r.json()["status"] in ("completed", "incomplete")
            pending = deliveries(c, on_hang["id"])
            assert len(pending) == 3 and {d["status"] for d in pending} == {"pending"}

            # A dead letter, redelivered to a live URL, arrives with its original id.
            moved = c.post(f"/webhooks/{on_dead['id']}", json={"url": rescue.url})
            assert moved.status_code == 200 and moved.json()["url"] == rescue.url
            rescue.secret = on_dead["secret"]
            r = c.post(f"/webhooks/{on_dead['id']}/deliveries/{dead[0]['id']}/redeliver")
            assert r.status_code == 200 and r.json()["status"] == "pending"
            assert rescue.wait_accepted(1, 60) and rescue.bad == []
            assert list(rescue.accepted) == [dead[0]["event"]["id"]]
            assert live.bad == [] and hanging.bad == []
            assert c.post(f"/webhooks/{on_dead['id']}/deliveries/nope/redeliver").status_code == 404
            assert c.delete(f"/webhooks/{on_dead['id']}").status_code == 200
            assert c.get(f"/webhooks/{on_dead['id']}/deliveries").status_code == 404
    finally:
        release.set()
        server.stop()
        for receiver in (live, rescue, hanging):
            receiver.close()
