"""A webhook receiver for the tests: a real HTTP server on loopback, in a thread of the test.

Every request is checked as a receiver would: the Standard Webhooks signature with the
`standardwebhooks` package (and the event parsed by the openai SDK's `webhooks.unwrap`, which
checks the same signature and OpenAI's event shape). What it answers is the test's `answer`
(the webhook-id, the how-many-th receipt of that id) -> an HTTP status, or None to kill the
connection without an answer; `before_answer` runs first (the crash test kills the service
there, so the delivery is in flight when it dies).
"""

from __future__ import annotations

import json
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import openai
import standardwebhooks


class Receiver:
    def __init__(self, answer: Callable[[str, int], int | None] = lambda _id, _n: 200) -> None:
        self.answer = answer
        self.before_answer: Callable[[str, dict[str, Any]], None] = lambda _id, _event: None
        # Extra headers of an answer: (the webhook-id, the how-many-th receipt) -> headers.
        self.answer_headers: Callable[[str, int], dict[str, str]] = lambda _id, _n: {}
        self.received_at: dict[str, list[float]] = defaultdict(list)  # webhook-id -> times
        self.secret: str | None = None
        self.lock = threading.Lock()
        self.receipts: dict[str, int] = defaultdict(int)  # webhook-id -> signed receipts
        self.accepted: dict[str, dict[str, Any]] = {}  # webhook-id -> event, once answered 2xx
        self.bad: list[str] = []  # what failed a check
        self.truncated = 0  # requests cut short by their sender's death
        self.changed = threading.Condition(self.lock)
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("content-length", "0"))
                body = self.rfile.read(length)
                if len(body) < length:  # the sender died mid-request (a kill): nothing to check
                    with receiver.lock:
                        receiver.truncated += 1
                    return
                receiver.handle(self, body)

            def log_message(self, *args: Any) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.http.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.http.serve_forever, daemon=True)
        self.thread.start()

    def handle(self, request: BaseHTTPRequestHandler, body: bytes) -> None:
        headers = {k.lower(): v for k, v in request.headers.items()}
        msg_id = headers.get("webhook-id", "")
        try:
            assert self.secret is not None
            standardwebhooks.Webhook(self.secret).verify(body, headers)
            event = openai.OpenAI(api_key="-", webhook_secret=self.secret).webhooks.unwrap(
                body, headers
            )
            assert event.id == msg_id and json.loads(body)["id"] == msg_id
            parsed = json.loads(body)
        except Exception as e:  # recorded: the test fails on any
            with self.lock:
                self.bad.append(f"{msg_id}: {type(e).__name__}: {e}")
            request.send_response(400)
            request.end_headers()
            return
        with self.lock:
            self.receipts[msg_id] += 1
            self.received_at[msg_id].append(time.time())
            n = self.receipts[msg_id]
        self.before_answer(msg_id, parsed)
        status = self.answer(msg_id, n)
        if status is None:
            request.close_connection = True
            return
        request.send_response(status)
        for name, value in self.answer_headers(msg_id, n).items():
            request.send_header(name, value)
        request.send_header("content-length", "0")
        request.end_headers()
        if 200 <= status < 300:
            with self.changed:
                self.accepted.setdefault(msg_id, parsed)
                self.changed.notify_all()

    def wait_accepted(self, n: int, timeout: float) -> bool:
        """Until `n` distinct webhook-ids were answered 2xx (False if `timeout` passed first)."""
        with self.changed:
            return self.changed.wait_for(lambda: len(self.accepted) >= n, timeout)

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()
