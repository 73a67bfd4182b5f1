"""Hardening (issue 12) of pairing and paired clients, each attack run against a real server:
pairing lock-out by a spamming local program (finding 7), files other local users could read
and a device code kept in an idempotency record (9), a `clients:admin` client approving itself
every scope (10), and a revoked client whose streams and tasks went on (11)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import threading
import time

import httpx
import pytest
from securityhelpers import ALL_SCOPES, bearer, database, events, pair, wait_task
from serverproc import ServerProcess, http_client

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SLOW = {"engine_token_delay": 0.05, "snapshot_interval": 0.02}


# -- finding 7: pairing lock-out ------------------------------------------------------------


def test_start_spam_does_not_lock_out_polling(lmsp_data):
    """One local program spams starts and polls; another, already started, still polls."""
    with (
        ServerProcess(lmsp_data, pairing_burst=4, pairing_rate_per_minute=1) as server,
        http_client(base_url=server.api, timeout=30) as anon,
    ):
        legit = anon.post("/pairings", json={"client_name": "legit", "scopes": ["tasks:read"]})
        assert legit.status_code == 201
        p = legit.json()
        spam = [
            anon.post("/pairings", json={"client_name": f"spam{i}", "scopes": ["tasks:read"]})
            for i in range(10)
        ]
        assert spam[-1].status_code == 429  # starts from this address are limited ...
        garbage = [
            anon.post(f"/pairings/pair_{i:032x}/token", json={"device_code": "lmspdc_x"})
            for i in range(30)
        ]
        assert garbage[-1].status_code == 429  # ... and so are polls for made-up pairings ...
        for _ in range(3):
            # ... but the started program's polls have their own bucket: pending, never 429.
            r = anon.post(f"/pairings/{p['id']}/token", json={"device_code": p["device_code"]})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["code"] in ("authorization_pending", "slow_down")


def test_polling_is_limited_per_pairing(lmsp_data):
    with (
        ServerProcess(lmsp_data, pairing_poll_burst=3, pairing_poll_rate_per_minute=1) as server,
        http_client(base_url=server.api, timeout=30) as anon,
    ):
        a, b = (
            anon.post("/pairings", json={"client_name": n, "scopes": ["tasks:read"]}).json()
            for n in ("a", "b")
        )
        codes = [
            anon.post(f"/pairings/{a['id']}/token", json={"device_code": a["device_code"]})
            for _ in range(5)
        ]
        assert [r.status_code for r in codes[:3]] == [400, 400, 400]
        assert codes[3].status_code == 429 and int(codes[3].headers["Retry-After"]) >= 1
        # Another pairing from the same address is not held back by the first one's polls.
        r = anon.post(f"/pairings/{b['id']}/token", json={"device_code": b["device_code"]})
        assert r.json()["error"]["code"] == "authorization_pending"


def test_pending_pairings_are_capped_by_ending_the_oldest_never_by_a_lock_out(lmsp_data):
    # Issue 43: at the cap, new starts were refused until the oldest expired (20 spam starts
    # locked pairing out for 9 minutes). Now a start always gets in, ending the oldest waiting.
    with (
        ServerProcess(lmsp_data, max_pending_pairings=3, pairing_burst=100) as server,
        http_client(base_url=server.api, timeout=30) as anon,
        server.client() as owner,
    ):
        started = [
            anon.post("/pairings", json={"client_name": f"p{i}", "scopes": ["tasks:read"]})
            for i in range(4)
        ]
        assert [r.status_code for r in started] == [201] * 4, started[-1].text
        listed = owner.get("/pairings").json()["data"]
        assert [x["client_name"] for x in listed] == ["p1", "p2", "p3"]  # oldest first
        p0 = started[0].json()
        r = anon.post(f"/pairings/{p0['id']}/token", json={"device_code": p0["device_code"]})
        assert r.status_code == 400 and r.json()["error"]["code"] == "expired_token"
        assert owner.post(f"/pairings/{p0['id']}/approve").json()["error"]["code"] == (
            "pairing_expired"
        )
        # A flood far over the cap, then a program that wants pairing: it gets in at once,
        # the owner sees and approves it, and it receives its token.
        for i in range(20):
            spam = anon.post(
                "/pairings", json={"client_name": f"spam{i}", "scopes": ["tasks:read"]}
            )
            assert spam.status_code == 201, spam.text
        wanted = anon.post("/pairings", json={"client_name": "real", "scopes": ["tasks:read"]})
        assert wanted.status_code == 201, wanted.text
        w = wanted.json()
        listed = owner.get("/pairings").json()["data"]
        assert [x["client_name"] for x in listed] == ["spam18", "spam19", "real"]
        assert owner.post(f"/pairings/{w['user_code']}/approve").status_code == 200
        token = anon.post(f"/pairings/{w['id']}/token", json={"device_code": w["device_code"]})
        assert token.status_code == 200 and token.json()["access_token"], token.text


# -- finding 9: files and stored secrets --------------------------------------------------------


def _mode(path):
    return stat.S_IMODE(path.stat().st_mode)


def test_data_folder_and_database_files_are_private(lmsp_data):
    # An existing data folder and database with the modes earlier releases left.
    os.chmod(lmsp_data, 0o755)
    with ServerProcess(lmsp_data) as server, server.client() as owner:
        assert owner.post("/responses", json={"input": "x", "max_output_tokens": 1}).is_success
    for path in lmsp_data.glob("lmsp.sqlite*"):
        os.chmod(path, 0o644)
    with ServerProcess(lmsp_data) as server, server.client() as owner:
        assert owner.post("/responses", json={"input": "x", "max_output_tokens": 1}).is_success
        assert _mode(lmsp_data) == 0o700
        files = sorted(lmsp_data.glob("lmsp.sqlite*"))
        assert {p.name for p in files} >= {"lmsp.sqlite", "lmsp.sqlite-wal", "lmsp.sqlite-shm"}
        for path in files:
            assert _mode(path) == 0o600, path


def test_fresh_data_folder_is_private(tmp_path, test_model_dir):
    data = tmp_path / "fresh" / "lmsp"
    old = os.umask(0o022)
    try:
        with ServerProcess(data, models={"tiny": test_model_dir}) as server, server.client() as c:
            assert c.get("/service").is_success
    finally:
        os.umask(old)
    assert _mode(data) == 0o700
    for path in data.glob("lmsp.sqlite*"):
        assert _mode(path) == 0o600, path


def test_a_keyed_pairing_start_stores_no_device_code(lmsp_data):
    with (
        ServerProcess(lmsp_data) as server,
        http_client(base_url=server.api, timeout=30) as anon,
        server.client() as owner,
    ):
        body = {"client_name": "keyed", "scopes": ["tasks:read"]}
        # (Without credentials a keyed start was a 401 already; with the owner's it was kept.)
        for client in (owner, anon):
            r = client.post("/pairings", json=body, headers={"Idempotency-Key": "start-1"})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["code"] == "idempotency_key_not_supported"
        started = anon.post("/pairings", json=body).json()
        conn = database(lmsp_data)
        try:
            stored = conn.execute("SELECT body FROM idempotency_keys").fetchall()
        finally:
            conn.close()
        assert not any(row["body"] and "lmspdc_" in row["body"] for row in stored)
        blob = b"".join(p.read_bytes() for p in lmsp_data.glob("lmsp.sqlite*"))
        assert started["device_code"].split("_", 1)[1].encode() not in blob


# -- finding 10: an approver grants only what it holds ----------------------------------------


def test_an_admin_client_cannot_escalate_or_approve_itself(lmsp_data):
    with (
        ServerProcess(lmsp_data, pairing_burst=100) as server,
        http_client(base_url=server.api, timeout=30) as anon,
    ):
        admin = pair(server, "admin-only", ["clients:admin", "tasks:read"])
        with bearer(server, admin["access_token"]) as x:
            # A pairing for every scope, started without credentials (by anyone, the admin
            # client included): the admin client may not grant what it does not hold.
            p = anon.post("/pairings", json={"client_name": "all", "scopes": ALL_SCOPES}).json()
            r = x.post(f"/pairings/{p['id']}/approve", json={})
            assert r.status_code == 403, r.text
            assert r.json()["error"]["code"] == "pairing_scopes_not_held"
            r = x.post(f"/pairings/{p['id']}/approve", json={"scopes": ["models:read"]})
            assert r.json()["error"]["code"] == "pairing_scopes_not_held"
            # It may grant what it holds.
            r = x.post(f"/pairings/{p['id']}/approve", json={"scopes": ["tasks:read"]})
            assert r.status_code == 200, r.text
            minted = anon.post(
                f"/pairings/{p['id']}/token", json={"device_code": p["device_code"]}
            ).json()
            assert minted["scopes"] == ["tasks:read"]

            # A pairing it started itself (with its token) it may not decide at all.
            own = x.post("/pairings", json={"client_name": "me-again", "scopes": ["tasks:read"]})
            assert own.status_code == 201
            for decision in ("approve", "deny"):
                r = x.post(f"/pairings/{own.json()['id']}/{decision}", json={})
                assert r.status_code == 403, r.text
                assert r.json()["error"]["code"] == "pairing_self_approval"

        # The client it minted does not outlive it: revoking the admin client revokes it too.
        with server.client() as owner:
            assert owner.delete(f"/clients/{admin['client_id']}").status_code == 200
            listed = {c["id"] for c in owner.get("/clients").json()["data"]}
            assert minted["client_id"] not in listed
        with bearer(server, minted["access_token"]) as m:
            assert m.get("/tasks").status_code == 401


# -- finding 11: revocation stops the client ----------------------------------------------------


def _read_stream(client, method, path, body, out):
    """Read an SSE stream to its end, recording when it ended and what it said.

    `out["open"]` (a threading.Event) is set once the answer's status is in and, for a stream
    that says something before its first token, once its first `data:` line has arrived: the
    readiness signal the test waits for before it revokes.
    """
    try:
        with client.stream(method, path, json=body) as r:
            out["status"] = r.status_code
            out["lines"] = []
            if not out["data_first"]:
                out["open"].set()
            for line in r.iter_lines():
                out["lines"].append(line)
                if line.startswith("data:"):
                    out["open"].set()
                    if "output_text.delta" in line:
                        out.setdefault("first_delta", time.monotonic())
    except httpx.HTTPError as e:
        out["error"] = repr(e)
    out["ended"] = time.monotonic()
    out["open"].set()  # (a stream that failed to open does not keep the test waiting)


def test_revoking_a_client_closes_its_streams_and_cancels_its_tasks(lmsp_data):
    with ServerProcess(lmsp_data, max_batch_size=2, **SLOW) as server:
        c = pair(server, "doomed", ["responses:write", "responses:read", "tasks:read"])
        with bearer(server, c["access_token"], timeout=60) as client, server.client() as owner:
            long = {"input": "Tell me a story.", "max_output_tokens": 2000, "temperature": 0}
            bg = [
                client.post("/responses", json={**long, "background": True}).json()
                for _ in range(3)
            ]  # two decode, one waits queued (max_batch_size 2)
            # The response stream says response.created at once and the task's event stream
            # replays its log; the chat stream says nothing before its task's first token (it
            # waits queued behind the two decoding tasks), so it is open once its 200 is in.
            streams = [
                {"open": threading.Event(), "data_first": data_first}
                for data_first in (True, True, False)
            ]
            threads = [
                threading.Thread(
                    target=_read_stream,
                    args=(client, "POST", "/responses", {**long, "stream": True}, streams[0]),
                ),
                threading.Thread(
                    target=_read_stream,
                    args=(
                        client,
                        "GET",
                        f"/tasks/{bg[0]['task_id']}/events?stream=true",
                        None,
                        streams[1],
                    ),
                ),
                threading.Thread(
                    target=_read_stream,
                    args=(
                        client,
                        "POST",
                        "/chat/completions",
                        {
                            "messages": [{"role": "user", "content": "Hi"}],
                            "max_tokens": 2000,
                            "stream": True,
                        },
                        streams[2],
                    ),
                ),
            ]
            for t in threads:
                t.start()
            wait_task(owner, bg[0]["task_id"], lambda t: t["state"] == "running")
            for s in streams:
                assert s["open"].wait(60), s
            # Every stream is open, following, and has not ended before the revocation.
            for t, s in zip(threads, streams, strict=True):
                assert t.is_alive() and "ended" not in s, s
                assert s["status"] == 200, s
            assert any(line.startswith("data:") for line in streams[0]["lines"]), streams[0]
            assert any(line.startswith("data:") for line in streams[1]["lines"]), streams[1]
            revoked_at = time.monotonic()
            r = owner.delete(f"/clients/{c['client_id']}")
            assert r.status_code == 200 and r.json()["revoked_at"] is not None
            for t in threads:
                t.join(10)
                assert not t.is_alive()
            for s in streams:
                assert s["ended"] - revoked_at < 1.0, s
            # Every unfinished task of the client ends cancelled, saying why.
            for response in bg:
                task = wait_task(owner, response["task_id"], timeout=30)
                assert task["state"] == "cancelled", task
                assert task["error"]["code"] == "client_revoked"
                log = events(owner, response["task_id"])
                assert log[-1]["type"] == "response.cancelled"
                assert log[-1]["response"]["error"]["code"] == "client_revoked"
            tasks = owner.get("/tasks", params={"limit": 100}).json()["data"]
            mine = [t for t in tasks if t["owner"] == c["client_id"]]
            assert len(mine) == 5
            for t in mine:
                done = wait_task(owner, t["id"], timeout=30)
                assert done["state"] == "cancelled", done


def test_revocation_from_the_command_line_keeps_tasks_from_resuming(lmsp_data):
    """Revoked while the server is down: its `resume` tasks must not continue at start-up."""
    with ServerProcess(lmsp_data, **SLOW) as server:
        c = pair(server, "doomed", ["responses:write", "responses:read", "tasks:read"])
        with bearer(server, c["access_token"]) as client:
            response = client.post(
                "/responses",
                json={
                    "input": "Tell me a story.",
                    "background": True,
                    "max_output_tokens": 2000,
                    "temperature": 0,
                },
            ).json()
            assert response["on_restart"] == "resume"
            wait_task(
                client,
                response["task_id"],
                lambda t: t["state"] == "running" and t["last_sequence_number"] > 6,
            )
        server.kill()
        revoked = subprocess.run(
            [
                sys.executable,
                "-m",
                "jupyter_lmsp.cli",
                "--data-dir",
                str(lmsp_data),
                "clients",
                "revoke",
                c["client_id"],
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert revoked.returncode == 0, revoked.stderr
        server.start()
        with server.client() as owner:
            task = wait_task(owner, response["task_id"], timeout=30)
            assert task["state"] == "cancelled", task
            assert task["error"]["code"] == "client_revoked"
            log = events(owner, response["task_id"])
            assert log[-1]["type"] == "response.cancelled"
            assert [e["sequence_number"] for e in log] == list(range(len(log)))
