"""Paired clients (LMSP B3) on a real server: the device flow driven from a separate process
and then the openai SDK with the issued token; an authorization matrix over every endpoint;
no secret in the database file; guessing limits; idempotency keys scoped per caller."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from serverproc import TOKEN, ServerProcess, http_client, with_test_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ALL_SCOPES = [
    "models:read",
    "models:write",
    "responses:read",
    "responses:write",
    "tasks:read",
    "tasks:write",
    "clients:admin",
    "metrics:read",
]


@pytest.fixture(scope="module")
def server(tmp_path_factory, test_model_dir):
    data = tmp_path_factory.mktemp("pairing")
    with_test_model(data, test_model_dir)
    with ServerProcess(data, pairing_burst=1000, pairing_rate_per_minute=6000) as server:
        yield server


def owner(server) -> httpx.Client:
    return server.client()


def pair(server, name: str, scopes: list[str], grant: list[str] | None = None) -> dict:
    """The whole flow over HTTP: start, owner approves, poll once for the token."""
    with http_client(base_url=server.api, timeout=30) as anon, owner(server) as own:
        started = anon.post("/pairings", json={"client_name": name, "scopes": scopes})
        assert started.status_code == 201, started.text
        p = started.json()
        assert re.fullmatch(r"[B-Z]{4}-[B-Z]{4}", p["user_code"])
        assert p["device_code"].startswith("lmspdc_") and p["interval"] >= 1
        body = {} if grant is None else {"scopes": grant}
        approved = own.post(f"/pairings/{p['id']}/approve", json=body)
        assert approved.status_code == 200, approved.text
        token = anon.post(f"/pairings/{p['id']}/token", json={"device_code": p["device_code"]})
        assert token.status_code == 200, token.text
        return {**token.json(), "pairing": p}


def bearer(server, token: str) -> httpx.Client:
    return http_client(
        base_url=server.api, headers={"Authorization": f"Bearer {token}"}, timeout=30
    )


def test_pairing_from_a_separate_process_then_the_openai_sdk(server):
    script = Path(__file__).with_name("pairing_client.py")
    proc = subprocess.Popen(
        [sys.executable, str(script), server.api, "notes-app", "responses:write,responses:read"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        first = json.loads(proc.stdout.readline())
        # The owner approves from the command line, against the server's database.
        approved = subprocess.run(
            [
                sys.executable,
                "-m",
                "jupyter_lmsp.cli",
                "--data-dir",
                str(server.data_dir),
                "pair",
                "approve",
                first["user_code"].lower().replace("-", ""),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert approved.returncode == 0, approved.stderr
        assert approved.stdout.startswith("approved")
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    result = json.loads(out.strip().splitlines()[-1])
    assert proc.returncode == 0, out
    assert result["scopes"] == ["responses:read", "responses:write"]
    assert result["status"] in ("completed", "incomplete")
    with owner(server) as own:
        clients = own.get("/clients").json()["data"]
        mine = next(c for c in clients if c["id"] == result["client_id"])
        assert mine["name"] == "notes-app" and mine["last_used_at"] is not None
        # The response belongs to the client; the owner sees it too.
        assert own.get(f"/responses/{result['response_id']}").status_code == 200


def test_token_released_exactly_once_and_denial(server):
    with http_client(base_url=server.api, timeout=30) as anon, owner(server) as own:
        p = anon.post("/pairings", json={"client_name": "a", "scopes": ["tasks:read"]}).json()
        poll = lambda code=p["device_code"]: anon.post(  # noqa: E731
            f"/pairings/{p['id']}/token", json={"device_code": code}
        )
        pending = poll()
        assert pending.status_code == 400
        assert pending.json()["error"]["code"] == "authorization_pending"
        fast = poll()
        assert fast.json()["error"]["code"] == "slow_down"
        listed = own.get("/pairings").json()["data"]
        assert any(x["id"] == p["id"] and "device_code" not in x for x in listed)
        assert (
            own.post(f"/pairings/{p['id']}/approve", json={"scopes": ["clients:admin"]}).json()[
                "error"
            ]["code"]
            == "pairing_scopes_not_requested"
        )
        assert own.post(f"/pairings/{p['id']}/approve", json={}).status_code == 200
        assert own.post(f"/pairings/{p['id']}/deny", json={}).status_code == 400  # decided
        time.sleep(0)  # the interval only limits pending polls
        first = poll()
        assert first.status_code == 200 and first.json()["access_token"].startswith("lmsp_")
        second = poll()
        assert second.status_code == 400 and second.json()["error"]["code"] == "expired_token"

        d = anon.post("/pairings", json={"client_name": "b", "scopes": ["tasks:read"]}).json()
        assert own.post(f"/pairings/{d['user_code']}/deny").status_code == 200
        denied = anon.post(f"/pairings/{d['id']}/token", json={"device_code": d["device_code"]})
        assert denied.json()["error"]["code"] == "access_denied"


def test_bad_pairing_requests(server):
    with http_client(base_url=server.api, timeout=30) as anon:
        for body, param in (
            ({"scopes": ["tasks:read"]}, "client_name"),
            ({"client_name": "x", "scopes": ["root"]}, "scopes"),
            ({"client_name": "x", "scopes": []}, "scopes"),
            ({"client_name": "x", "scopes": "tasks:read"}, "scopes"),
        ):
            r = anon.post("/pairings", json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, body
        assert anon.post("/pairings/pair_nope/token", json={"device_code": "x"}).status_code == 404
        # Listing and deciding pairings is the owner's.
        assert anon.get("/pairings").status_code == 401
        assert anon.post("/pairings/pair_nope/approve").status_code == 401


@pytest.fixture(scope="module")
def matrix(server):
    """Credentials for the matrix: a full client, a narrow client, a revoked one, and a
    response and a task owned by the full client, and one owned by the owner."""
    full = pair(server, "full", ALL_SCOPES)
    narrow = pair(server, "narrow", ["models:read"])
    revoked = pair(server, "revoked", ALL_SCOPES)
    with owner(server) as own:
        assert own.delete(f"/clients/{revoked['client_id']}").status_code == 200
        mine = own.post("/responses", json={"input": "owner's", "max_output_tokens": 2}).json()
    with bearer(server, full["access_token"]) as c:
        theirs = c.post("/responses", json={"input": "client's", "max_output_tokens": 2}).json()
    return {
        "full": full,
        "narrow": narrow,
        "revoked": revoked,
        "owner_resp": mine,
        "client_resp": theirs,
    }


def endpoints(m) -> list[tuple[str, str, str | None, dict | None]]:
    """(method, path, scope, body) for every endpoint that takes credentials, on resources the
    *owner* created. (`openapi.json`, starting a pairing and polling for its token are public.)"""
    r = m["owner_resp"]
    return [
        ("GET", "/models", "models:read", None),
        ("GET", "/models/tiny", "models:read", None),
        ("POST", "/responses", "responses:write", {"input": "x", "max_output_tokens": 1}),
        ("GET", f"/responses/{r['id']}", "responses:read", None),
        ("GET", f"/responses/{r['id']}/input_items", "responses:read", None),
        ("POST", f"/responses/{r['id']}/cancel", "responses:write", {}),
        ("DELETE", f"/responses/{r['id']}", "responses:write", None),
        ("GET", "/tasks", "tasks:read", None),
        ("GET", f"/tasks/{r['task_id']}", "tasks:read", None),
        ("GET", f"/tasks/{r['task_id']}/events", "tasks:read", None),
        ("POST", f"/tasks/{r['task_id']}/cancel", "tasks:write", {}),
        ("GET", "/pairings", "clients:admin", None),
        ("POST", "/pairings/pair_nope/approve", "clients:admin", {}),
        ("POST", "/pairings/pair_nope/deny", "clients:admin", {}),
        ("GET", "/clients", "clients:admin", None),
        ("DELETE", "/clients/client_nope", "clients:admin", None),
        ("POST", "/models", "models:write", {"source": "/nonexistent/model"}),
        ("DELETE", "/models/nope", "models:write", None),
        (
            "POST",
            "/chat/completions",
            "responses:write",
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1},
        ),
        ("GET", "/metrics", "metrics:read", None),
        ("GET", "/service", None, None),
    ]


def send(server, method, path, body, headers):
    with http_client(base_url=server.api, timeout=30) as c:
        return c.request(method, path, json=body, headers=headers)


def check_401(r):
    assert r.status_code == 401, (r.request.url, r.text)
    assert r.headers["WWW-Authenticate"].startswith("Bearer")
    assert r.json()["error"]["type"] == "authentication_error"


def test_matrix_no_credentials_malformed_unknown_revoked(server, matrix):
    for method, path, _, body in endpoints(matrix):
        if method == "DELETE" and path.startswith("/responses"):
            continue
        for headers in (
            {},
            {"Authorization": "Bearer"},
            {"Authorization": "Basic dXNlcjpwYXNz"},
            {"Authorization": "Bearer lmsp_" + "A" * 43},
            {"Authorization": f"Bearer {matrix['revoked']['access_token']}"},
        ):
            check_401(send(server, method, path, body, headers))


def test_matrix_missing_scope_is_403(server, matrix):
    narrow = {"Authorization": f"Bearer {matrix['narrow']['access_token']}"}
    for method, path, scope, body in endpoints(matrix):
        r = send(server, method, path, body, narrow)
        if scope in ("models:read", None):
            assert r.status_code == 200, (path, r.text)
        else:
            assert r.status_code == 403, (path, r.text)
            assert r.json()["error"]["code"] == "insufficient_scope"
            assert scope in r.headers["WWW-Authenticate"]


def test_matrix_other_callers_resources_are_404(server, matrix):
    full = {"Authorization": f"Bearer {matrix['full']['access_token']}"}
    for method, path, _, body in endpoints(matrix):
        if not re.search(r"/(responses|tasks)/", path):
            continue
        r = send(server, method, path, body, full)
        assert r.status_code == 404, (method, path, r.text)
    with bearer(server, matrix["full"]["access_token"]) as c:
        listed = {t["id"] for t in c.get("/tasks", params={"limit": 100}).json()["data"]}
        assert matrix["client_resp"]["task_id"] in listed
        assert matrix["owner_resp"]["task_id"] not in listed
        assert c.get(f"/responses/{matrix['client_resp']['id']}").status_code == 200


def test_matrix_what_paired_clients_see_and_may_do(server, matrix):
    """Beyond scopes (issue 12): no host paths for any paired client, registration only from
    the allowed folders (one error for everything else), no approving one's own pairing."""
    full = {"Authorization": f"Bearer {matrix['full']['access_token']}"}
    narrow = {"Authorization": f"Bearer {matrix['narrow']['access_token']}"}
    for headers in (full, narrow):
        listed = send(server, "GET", "/models", None, headers).json()["data"]
        one = send(server, "GET", "/models/tiny", None, headers).json()
        for model in [*listed, one]:
            assert model["path"] is None and model["files"] is None and model["source"] is None
    with owner(server) as own:
        assert own.get("/models/tiny").json()["path"].endswith("tiny")
        missing = own.post("/models", json={"source": "/nonexistent/model"})
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "source_not_found"
    for source in ("/nonexistent/model", "/etc", str(server.data_dir)):
        r = send(server, "POST", "/models", {"source": source}, full)
        assert r.status_code == 400 and r.json()["error"]["code"] == "source_unusable", r.text
    for headers in (full, narrow):  # nor the BLAS libraries' files in the service's report
        service = send(server, "GET", "/service", None, headers).json()
        assert "paths" not in (service["blas"] or {})
        assert sys.prefix not in json.dumps(service)
    with owner(server) as own:
        blas = own.get("/service").json()["blas"]
        assert blas["state"] == "chosen" and "paths" in blas  # the owner sees them
    started = send(
        server, "POST", "/pairings", {"client_name": "x", "scopes": ["tasks:read"]}, full
    )
    assert started.status_code == 201
    r = send(server, "POST", f"/pairings/{started.json()['id']}/approve", {}, full)
    assert r.status_code == 403 and r.json()["error"]["code"] == "pairing_self_approval"


def test_matrix_jupyter_token_has_full_access(server, matrix):
    for headers in ({"Authorization": f"token {TOKEN}"}, {"Authorization": f"Bearer {TOKEN}"}):
        with http_client(base_url=server.api, timeout=30, headers=headers) as c:
            assert c.get(f"/responses/{matrix['client_resp']['id']}").status_code == 200
            assert c.get("/clients").status_code == 200
            assert c.get(f"/tasks/{matrix['owner_resp']['task_id']}/events").status_code == 200


def test_matrix_browser_cookie_needs_xsrf(server, matrix):
    with http_client(base_url=server.url, timeout=30, follow_redirects=False) as browser:
        login = browser.get("/login")
        xsrf = browser.cookies.get("_xsrf")
        assert xsrf, login.text[:200]
        r = browser.post("/login", data={"password": TOKEN, "_xsrf": xsrf})
        assert r.status_code in (302, 303), r.text[:300]
        api = "/lmsp/v1"
        # A GET with the cookie is the Jupyter user's.
        assert browser.get(f"{api}/tasks").status_code == 200
        # A POST with the cookie and without the XSRF token is refused.
        forged = browser.post(f"{api}/responses", json={"input": "x", "max_output_tokens": 1})
        assert forged.status_code == 403
        assert forged.json()["error"]["type"] == "permission_error"
        ok = browser.post(
            f"{api}/responses",
            json={"input": "x", "max_output_tokens": 1},
            headers={"X-XSRFToken": xsrf},
        )
        assert ok.status_code == 200, ok.text


def _declared_body(server, method: str, path: str, headers: dict[str, str]) -> bytes:
    """The answer to `method path` declaring a 300 MiB body it never sends."""
    lines = [f"{method} /lmsp/v1{path} HTTP/1.1", "Host: 127.0.0.1"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    lines.append(f"Content-Length: {300 * 1024 * 1024}")
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


def test_matrix_oversized_bodies_are_413_whoever_sends_them(server, matrix):
    """Issue 12 item 1: the size limit comes before credentials, on every endpoint (the public
    ones too), so no one gets a body read that the service would refuse."""
    narrow = {"Authorization": f"Bearer {matrix['narrow']['access_token']}"}
    revoked = {"Authorization": f"Bearer {matrix['revoked']['access_token']}"}
    owner_token = {"Authorization": f"token {TOKEN}"}
    routes = [(m, p) for m, p, _, _ in endpoints(matrix)]
    routes += [("POST", "/pairings"), ("POST", "/pairings/pair_x/token"), ("GET", "/openapi.json")]
    for method, path in routes:
        for headers in ({}, narrow, revoked, owner_token):
            answer = _declared_body(server, method, path, headers)
            assert answer.startswith(b"HTTP/1.1 413"), (method, path, headers, answer[:100])


def test_public_routes_take_no_idempotency_key(server):
    """Nothing is keyed before the caller is known: the credential-free routes refuse the key
    instead of digesting the body under it."""
    with http_client(base_url=server.api, timeout=30) as anon:
        r = anon.post(
            "/pairings",
            json={"client_name": "keyed", "scopes": ["tasks:read"]},
            headers={"Idempotency-Key": "k"},
        )
        assert r.status_code == 400
        assert r.json()["error"]["code"] == "idempotency_key_not_supported"
        r = anon.post(
            "/pairings/pair_x/token", json={"device_code": "x"}, headers={"Idempotency-Key": "k"}
        )
        assert r.status_code == 400
        assert r.json()["error"]["code"] == "idempotency_key_not_supported"


def test_matrix_service_hides_the_worker_pid_from_paired_clients(server, matrix):
    with owner(server) as own:
        deadline = time.monotonic() + 60
        while own.get("/service").json()["worker"]["state"] != "ready":
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert isinstance(own.get("/service").json()["worker"]["pid"], int)
    for who in ("full", "narrow"):
        with bearer(server, matrix[who]["access_token"]) as c:
            worker = c.get("/service").json()["worker"]
        assert worker["state"] == "ready" and "pid" not in worker, who


def test_idempotency_keys_are_per_caller(server, matrix):
    body = {"input": "same", "background": True, "max_output_tokens": 1}
    headers = {"Idempotency-Key": "shared-key"}
    with bearer(server, matrix["full"]["access_token"]) as c, owner(server) as own:
        a = c.post("/responses", json=body, headers=headers)
        b = own.post("/responses", json=body, headers=headers)
        assert a.status_code == b.status_code == 202
        assert a.json()["id"] != b.json()["id"]
        assert "Idempotent-Replayed" not in b.headers


def test_no_secret_in_the_database_file(server, matrix):
    secrets = [matrix[k]["access_token"] for k in ("full", "narrow", "revoked")]
    secrets += [matrix[k]["pairing"]["device_code"] for k in ("full", "narrow", "revoked")]
    blob = b""
    for path in server.data_dir.glob("lmsp.sqlite*"):
        blob += path.read_bytes()
    assert blob
    for secret in secrets:
        assert secret.encode() not in blob
        # nor the random part without its prefix
        assert secret.split("_", 1)[1].encode() not in blob


def test_guessing_is_bounded_by_attempts_and_rate(tmp_path, test_model_dir):
    with_test_model(tmp_path, test_model_dir)
    with (
        # Buckets that refill once in ten minutes: the counts below are the bursts, however
        # slowly a loaded machine sends the requests (at 30 a minute one refilled mid-count).
        ServerProcess(
            tmp_path,
            pairing_poll_burst=12,
            pairing_poll_rate_per_minute=0.1,
            pairing_rate_per_minute=0.1,
        ) as server,
        http_client(base_url=server.api, timeout=30) as anon,
    ):
        p = anon.post("/pairings", json={"client_name": "victim", "scopes": ["tasks:read"]}).json()
        verdicts = []
        for i in range(8):
            r = anon.post(f"/pairings/{p['id']}/token", json={"device_code": f"lmspdc_guess{i}"})
            verdicts.append(r.json()["error"]["code"])
        # Every wrong guess is refused, and after 5 the pairing is dead even for the right code.
        assert verdicts == ["invalid_grant"] * 8
        right = anon.post(f"/pairings/{p['id']}/token", json={"device_code": p["device_code"]})
        assert right.json()["error"]["code"] == "expired_token"
        # Polls are limited per pairing (12 in a burst): the pairing has used 9 of its 12.
        for _ in range(3):
            r = anon.post(f"/pairings/{p['id']}/token", json={"device_code": "lmspdc_more"})
            assert r.status_code == 400
        r = anon.post(f"/pairings/{p['id']}/token", json={"device_code": "lmspdc_more"})
        assert r.status_code == 429
        # Polls for pairings that do not exist share one bucket per address: 12, then 429.
        allowed = 0
        while True:
            r = anon.post("/pairings/pair_x/token", json={"device_code": "lmspdc_x"})
            if r.status_code == 429:
                break
            allowed += 1
            assert allowed < 100
        assert allowed == 12
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
        assert int(r.headers["Retry-After"]) >= 1
        # Starting (issue 43): a body over 4 KiB is refused unread; the start limit (burst 10,
        # one used) is checked before a body is parsed: malformed ones are 400s, then 429s.
        big = {"client_name": "x" * 5000, "scopes": ["tasks:read"]}
        # On a connection of its own: the server refuses it unread and closes that connection,
        # which a pooled client could otherwise reuse for the next request (a reset).
        assert httpx.post(f"{server.api}/pairings", json=big, timeout=30).status_code == 413
        codes = [
            anon.post("/pairings", content=b"{", headers={"Content-Type": "application/json"})
            for _ in range(10)
        ]
        assert [c.status_code for c in codes] == [400] * 9 + [429], [c.text for c in codes]


def test_a_client_name_cannot_hide_behind_control_or_bidi_characters(server):
    """Issue 43: the owner reads the name on the approval card."""
    with http_client(base_url=server.api, timeout=30) as anon:
        for name in ("evil\u202egnp.exe", "nul\x00byte", "two\nlines", "zero\u200bwidth"):
            r = anon.post("/pairings", json={"client_name": name, "scopes": ["tasks:read"]})
            assert r.status_code == 400, (name, r.text)
            assert r.json()["error"]["param"] == "client_name"
        fine = anon.post("/pairings", json={"client_name": "Café ☕", "scopes": ["tasks:read"]})
        assert fine.status_code == 201, fine.text
