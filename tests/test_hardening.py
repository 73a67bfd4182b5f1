"""The request path under attack, against a real `jupyter server` (issue 12, items 1, 8, 12).

- Oversized bodies are refused with 413 before anything reads them, on every route and without
  credentials: three concurrent 300 MiB bodies leave the server's memory and event loop alone.
- Malformed input is a 400, never a 500: deep nesting, integers beyond Python's 4,300 digits,
  lone surrogates, huge sequence numbers.
- No credential from a URL reaches the log.
- Connections that never finish their headers (or body) are closed.
- A paired client does not see the inference worker's process id.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from serverproc import TOKEN, ServerProcess, http_client, with_test_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MiB = 1024 * 1024
ATTACK_BYTES = 300 * MiB


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, test_model_dir: Path
) -> Iterator[ServerProcess]:
    data = with_test_model(tmp_path_factory.mktemp("hardening"), test_model_dir)
    with ServerProcess(
        data,
        header_timeout=2,
        body_timeout=2,
        pairing_burst=1000,
        pairing_rate_per_minute=60000,
        options=["--log-level=DEBUG"],
    ) as server:
        yield server


def _rss(pid: int) -> int:
    return psutil.Process(pid).memory_info().rss


def _send_oversized(port: int, path: str, *, chunked: bool, headers: str = "") -> bytes:
    """POST `ATTACK_BYTES` to `path`, as fast as the server takes them; what it answered."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    try:
        framing = (
            "Transfer-Encoding: chunked\r\n" if chunked else f"Content-Length: {ATTACK_BYTES}\r\n"
        )
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"{headers}{framing}\r\n".encode()
        )
        block = b"[" * MiB
        sent = 0
        try:
            while sent < ATTACK_BYTES:
                sock.sendall(b"%x\r\n%s\r\n" % (len(block), block) if chunked else block)
                sent += len(block)
        except OSError:
            pass  # the server closed the connection: what it answered is in the buffer
        answer = b""
        try:
            while chunk := sock.recv(65536):
                answer += chunk
        except OSError:
            pass
        return answer
    finally:
        sock.close()


class LoopProbe:
    """Times a cheap authenticated GET in a loop: the longest answer bounds the server's
    event-loop stalls while it runs."""

    def __init__(self, server: ServerProcess) -> None:
        self.server = server
        self.times: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with self.server.client(timeout=60) as c:
            while not self._stop.is_set():
                started = time.perf_counter()
                assert c.get("/service").status_code == 200
                self.times.append(time.perf_counter() - started)
                time.sleep(0.01)

    def __enter__(self) -> LoopProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_three_concurrent_300_mib_bodies_are_refused_unread(server, chunked):
    """Item 1: unauthenticated, on the public pairing route (the one that used to digest the
    whole body before knowing the caller) and on an authenticated one."""
    assert server.proc is not None
    idle = _rss(server.proc.pid)
    peak = idle
    answers: list[bytes] = []
    targets = [
        ("/lmsp/v1/pairings", ""),
        ("/lmsp/v1/pairings", "Idempotency-Key: k1\r\n"),
        ("/lmsp/v1/responses", f"Authorization: token {TOKEN}\r\n"),
    ]
    threads = [
        threading.Thread(
            target=lambda p=path, h=headers: answers.append(
                _send_oversized(server.port, p, chunked=chunked, headers=h)
            )
        )
        for path, headers in targets
    ]
    with LoopProbe(server) as probe:
        time.sleep(0.3)
        # What counts is the loop while the bodies arrive: the first probes (a new connection,
        # the server's first GET /service) are not part of the attack.
        probe.times.clear()
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            peak = max(peak, _rss(server.proc.pid))
            time.sleep(0.02)
        time.sleep(0.3)
    print(
        f"3 x 300 MiB ({'chunked' if chunked else 'Content-Length'}): RSS +"
        f"{(peak - idle) / MiB:.1f} MiB, slowest of {len(probe.times)} probes "
        f"{max(probe.times) * 1e3:.1f} ms"
    )
    assert len(answers) == 3
    for answer in answers:
        assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
        body = json.loads(answer.split(b"\r\n\r\n", 1)[1].split(b"\r\n0\r\n")[0] or b"{}")
        assert body["error"]["code"] == "request_too_large"
    assert peak - idle < 100 * MiB, f"RSS grew {(peak - idle) / MiB:.0f} MiB"
    # The target is a stall under 100 ms (21 ms measured on a quiet machine; printed above).
    # A probe is a whole request, at the mercy of the scheduler on a loaded 2-CPU machine, so
    # the test bounds it at 0.5 s: the code before the fix stalled 1.8-7.7 s on these bodies.
    assert probe.times and max(probe.times) < 0.5, f"slowest probe {max(probe.times):.3f} s"


def test_every_route_refuses_an_oversized_declared_body(server):
    """The size is judged from `Content-Length` alone: these bodies are declared, never sent,
    and every route (public, authenticated, unknown) answers 413 at once."""
    for method, path in [
        ("GET", "/service"),
        ("GET", "/openapi.json"),
        ("POST", "/pairings/pair_x/token"),
        ("POST", "/chat/completions"),
        ("DELETE", "/models/x"),
        ("POST", "/no/such/route"),
    ]:
        answer = _declared_only(server.port, method, "/lmsp/v1" + path)
        assert answer.startswith(b"HTTP/1.1 413"), (method, path, answer[:200])


def _declared_only(port: int, method: str, path: str) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(
            f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {ATTACK_BYTES}\r\n"
            "\r\n".encode()
        )
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
        return answer


BAD_INPUT = [
    # (method, path, body, param)
    ("POST", "/responses", "[" * 100_000 + "]" * 100_000, None),
    ("POST", "/responses", '{"input": ' + "[" * 5000 + "]" * 5000 + "}", None),
    ("POST", "/responses", '{"input": "x", "seed": ' + "9" * 5000 + "}", None),
    ("POST", "/responses", '{"input": "x", "temperature": 1e999}', None),
    ("POST", "/responses", '{"input": "x", "temperature": NaN}', None),
    ("POST", "/pairings", '{"client_name": "\\ud800", "scopes": ["tasks:read"]}', "client_name"),
    ("POST", "/responses", '{"input": "\\udfff"}', "input"),
    (
        "POST",
        "/chat/completions",
        '{"messages": [{"role": "user", "content": "\\ud83d"}]}',
        "messages[0].content",
    ),
    ("GET", "/tasks/task_x/events?after=" + "9" * 40, None, "after"),
    ("GET", "/tasks/task_x/events?after=" + "9" * 5000, None, "after"),
    ("GET", "/tasks/task_x/events?stream=true&starting_after=" + "9" * 30, None, "starting_after"),
    ("GET", "/responses/resp_x?stream=true&starting_after=-" + "9" * 30, None, "starting_after"),
    ("GET", "/tasks?limit=" + "9" * 30, None, "limit"),
    ("GET", "/responses/resp_x/input_items?limit=1e3", None, "limit"),
]


@pytest.mark.parametrize(("method", "path", "body", "param"), BAD_INPUT)
def test_malformed_input_is_a_400_never_a_500(server, method, path, body, param):
    """Item 8."""
    with server.client() as c:
        r = c.request(method, path, content=body)
    assert r.status_code == 400, r.text[:300]
    assert set(r.json()["error"]) == {"type", "code", "message", "param"}
    if param is not None:
        assert r.json()["error"]["param"] == param


def test_huge_last_event_id_is_a_400(server):
    with server.client() as c:
        r = c.get(
            "/tasks/task_x/events",
            headers={"Last-Event-ID": "9" * 40, "Accept": "text/event-stream"},
        )
    assert r.status_code == 400 and r.json()["error"]["param"] == "Last-Event-ID"


def test_no_token_reaches_the_log(tmp_path, test_model_dir):
    """Item 8: Jupyter accepts its token in the URL (`?token=…`); neither LMSP's debug line
    for a refused request nor the uncaught-exception line of a failing one may write it."""
    with_test_model(tmp_path, test_model_dir)
    with ServerProcess(
        tmp_path,
        options=["--log-level=DEBUG"],
        env={"LMSP_FAILPOINTS": "raise_in_listTasks"},
    ) as server:
        with http_client(base_url=server.api, timeout=30) as c:
            # The fail point fires in `listTasks`: a 500, logged with its traceback.
            r = c.get("/tasks", params={"token": TOKEN})
            assert r.status_code == 500
            # Refused before any operation runs (no such route; a body too large), or by it
            # (a body nested too deep: the 500 whose log line used to hold the raw URL).
            assert c.get("/nothing", params={"token": TOKEN}).status_code == 404
            deep = "[" * 100_000 + "]" * 100_000
            assert c.post("/responses", params={"token": TOKEN}, content=deep).status_code == 400
        answer = _declared_only(
            server.port, "POST", f"/lmsp/v1/responses?token={TOKEN}&device_code=lmspdc_secret"
        )
        assert answer.startswith(b"HTTP/1.1 413")
        log = server.log_path.read_text(errors="replace")
    assert "Uncaught exception" in log and "fail point raise_in_listTasks" in log
    assert "/lmsp/v1/tasks?token=[secret]" in log
    # Jupyter's own start-up banner shows the server's URL with its token, for its user to
    # open; no line about a request may.
    leaked = [line for line in log.splitlines() if TOKEN in line and "lmsp" in line]
    assert not leaked, leaked
    assert "lmspdc_secret" not in log


def _half_open(port: int, count: int) -> list[socket.socket]:
    socks = []
    for _ in range(count):
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
        s.sendall(b"GET /lmsp/v1/service HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # no blank line
        socks.append(s)
    return socks


def test_half_open_connections_are_closed(server):
    """Item 12: 200 connections that never finish their headers are closed after the header
    timeout (2 s here; Tornado's default is an hour), and one whose body stalls after the body
    timeout."""
    socks = _half_open(server.port, 200)
    stalled = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    stalled.sendall(
        f"POST /lmsp/v1/responses HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: token {TOKEN}\r\n"
        "Content-Length: 100\r\n\r\n{".encode()
    )
    socks.append(stalled)
    try:
        started = time.monotonic()
        for s in socks:
            s.settimeout(max(0.1, 15 - (time.monotonic() - started)))
            assert s.recv(1024) == b"", "the server kept a half-open connection"
        assert time.monotonic() - started < 15
    finally:
        for s in socks:
            s.close()


def test_the_worker_pid_is_the_owners_to_see(server):
    """Item 12: the owner sees the inference worker's process id; a paired client does not."""
    with server.client() as own:
        deadline = time.monotonic() + 60
        while own.get("/service").json()["worker"]["state"] != "ready":
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert isinstance(own.get("/service").json()["worker"]["pid"], int)
    with http_client(base_url=server.api, timeout=30) as anon, server.client() as own:
        p = anon.post("/pairings", json={"client_name": "c", "scopes": ["models:read"]}).json()
        assert own.post(f"/pairings/{p['id']}/approve", json={}).status_code == 200
        token = anon.post(f"/pairings/{p['id']}/token", json={"device_code": p["device_code"]})
        headers = {"Authorization": f"Bearer {token.json()['access_token']}"}
        worker = anon.get("/service", headers=headers).json()["worker"]
    assert worker["state"] == "ready" and "pid" not in worker


def _exchange(sock: socket.socket, request: str) -> bytes:
    """Send one request on a kept-alive connection and read its whole answer."""
    sock.sendall(request.encode())
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection"
        head += chunk
    head, body = head.split(b"\r\n\r\n", 1)
    length = int(
        next(
            line.split(b":")[1]
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length")
        )
    )
    while len(body) < length:
        body += sock.recv(65536)
    return head


def test_refusals_without_a_body_keep_the_connection_open(server):
    """A 404 or a 401 for a request without a body is answered once Tornado has read its (empty)
    body, so a client's kept-alive connection stays usable; only a body left unread closes it."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        get = "GET /lmsp/v1/{} HTTP/1.1\r\nHost: 127.0.0.1\r\n{}\r\n"
        assert _exchange(sock, get.format("no/such/thing", "")).startswith(b"HTTP/1.1 404")
        assert _exchange(sock, get.format("service", "")).startswith(b"HTTP/1.1 401")
        bad = "Authorization: Bearer lmsp_unknown\r\n"
        assert _exchange(sock, get.format("tasks", bad)).startswith(b"HTTP/1.1 401")
        good = f"Authorization: token {TOKEN}\r\n"
        assert _exchange(sock, get.format("service", good)).startswith(b"HTTP/1.1 200")
