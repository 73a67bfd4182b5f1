"""The real Codex CLI (`codex exec`, the npm package's native binary) against a real `jupyter
server` running the extension (issue 36): with its default settings — only `web_search`
disabled, and its update check, analytics and feedback off so nothing leaves loopback — it sends
its own requests (its full system prompt, its tools and namespaces, `tool_choice: auto`,
`store: false`, encrypted reasoning included, ...), gets every one accepted, runs the shell
command the model calls for, sends the result back and completes the turn with the model's
answer.

The model is tests/scriptedmodel.py, built so that greedy decoding calls Codex's `exec_command`
tool (`echo scripted-hi`) when the prompt holds no tool result and answers in text once it
does: Codex's own request (tool_choice auto) can then produce a tool call and a final answer
without any grammar forcing them. A recording proxy on loopback sits between Codex and the
server and keeps every request and the status it got.

Codex comes from tests/node/package-lock.json (`make node-clients`); without it the test skips,
or fails when `CI` is set.
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from nodeclients import codex_binary, require_node_clients
from scriptedmodel import ANSWER_TEXT, CALL_NAME, CALL_TEXT, COMMAND, make_scripted_model
from serverproc import TOKEN, ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MODEL = "scripted"
PROMPT = "Run a shell command that prints a greeting, then tell me what it printed."
# Hop-by-hop headers, and the ones the proxy sets itself.
NOT_FORWARDED = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "host",
    "content-length",
}


# -- a recording proxy ------------------------------------------------------------------------


@dataclass
class Exchange:
    method: str
    path: str
    status: int
    request: Any  # the JSON body, if any
    events: list[dict[str, Any]] = field(default_factory=list)  # an SSE answer's data


class RecordingProxy:
    """A loopback HTTP proxy in front of `upstream` (an origin): forwards each request as it
    is, streams the answer back as it comes, and records both in `exchanges`."""

    def __init__(self, upstream: str) -> None:
        target = urlsplit(upstream)
        host, port = target.hostname or "127.0.0.1", target.port
        self.exchanges: list[Exchange] = []
        lock = threading.Lock()
        exchanges = self.exchanges

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def forward(self) -> None:
                assert "chunked" not in self.headers.get("Transfer-Encoding", "")
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                headers = {k: v for k, v in self.headers.items() if k.lower() not in NOT_FORWARDED}
                conn = http.client.HTTPConnection(host, port, timeout=300)
                try:
                    conn.request(self.command, self.path, body=body or None, headers=headers)
                    answer = conn.getresponse()
                    self.send_response(answer.status, answer.reason)
                    for k, v in answer.getheaders():
                        if k.lower() not in NOT_FORWARDED:
                            self.send_header(k, v)
                    self.send_header("Connection", "close")
                    self.end_headers()
                    received = bytearray()
                    while chunk := answer.read1(65536):
                        received += chunk
                        self.wfile.write(chunk)
                        self.wfile.flush()
                finally:
                    conn.close()
                self.close_connection = True
                try:
                    request = json.loads(body) if body else None
                except ValueError:
                    request = body.decode(errors="replace")
                exchange = Exchange(self.command, self.path, answer.status, request)
                if answer.getheader("Content-Type", "").startswith("text/event-stream"):
                    exchange.events = [
                        json.loads(line[len("data:") :])
                        for line in received.decode().splitlines()
                        if line.startswith("data:") and line[len("data:") :].strip() != "[DONE]"
                    ]
                with lock:
                    exchanges.append(exchange)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = do_OPTIONS = forward

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def origin(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def __enter__(self) -> RecordingProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()


# -- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def codex() -> Path:
    return codex_binary(require_node_clients())


@pytest.fixture(scope="module")
def server(codex: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model_dir = make_scripted_model(tmp_path_factory.mktemp("scripted-model"))
    data_dir = tmp_path_factory.mktemp("codex-server")
    (data_dir / "models").mkdir()
    (data_dir / "models" / MODEL).symlink_to(model_dir)
    server = ServerProcess(data_dir, default_model=MODEL)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def codex_config(base_url: str) -> str:
    """Codex's config.toml: the server as a custom Responses provider, `web_search` disabled;
    everything else Codex's defaults, apart from what would reach beyond loopback."""
    return f"""\
model = "{MODEL}"
model_provider = "lmsp"
web_search = "disabled"
check_for_update_on_startup = false

[analytics]
enabled = false

[feedback]
enabled = false

[model_providers.lmsp]
name = "jupyter-lmsp test server"
base_url = "{base_url}"
env_key = "LMSP_TOKEN"
wire_api = "responses"
"""


def run_codex(
    codex: Path, base_url: str, tmp_path: Path
) -> tuple[subprocess.CompletedProcess[str], list[dict[str, Any]]]:
    home, codex_home, work = tmp_path / "home", tmp_path / "codex-home", tmp_path / "work"
    for folder in (home, codex_home, work):
        folder.mkdir()
    (codex_home / "config.toml").write_text(codex_config(base_url))
    subprocess.run(["git", "init", "-q", str(work)], check=True)
    # A proxy that refuses every connection for whatever is not loopback.
    unreachable = "http://127.0.0.1:9"
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "CODEX_HOME": str(codex_home),
        "LMSP_TOKEN": TOKEN,
        "HTTP_PROXY": unreachable,
        "HTTPS_PROXY": unreachable,
        "ALL_PROXY": unreachable,
        "NO_PROXY": "127.0.0.1,localhost",
        "RUST_LOG": "warn",
    }
    ran = subprocess.run(
        [str(codex), "exec", "--json", "--strict-config", "-C", str(work), PROMPT],
        cwd=work,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=240,
    )
    events = [json.loads(line) for line in ran.stdout.splitlines() if line.startswith("{")]
    return ran, events


def output_items(exchange: Exchange) -> list[dict[str, Any]]:
    done = [e for e in exchange.events if e.get("type") == "response.completed"]
    assert len(done) == 1, [e.get("type") for e in exchange.events]
    items: list[dict[str, Any]] = done[0]["response"]["output"]
    return items


# -- the tests --------------------------------------------------------------------------------


def test_the_scripted_model_calls_then_answers(tmp_path: Path) -> None:
    """The scripted model in mlx-lm alone, behind a long prompt (Codex's is ~25k of its
    tokens): greedy decoding gives the call without a tool result in the prompt, the answer
    with one, each then end-of-sequence."""
    from mlx_lm import generate, load
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = load(str(make_scripted_model(tmp_path / "model")))[:2]
    long = " ".join(["You are a coding agent in a terminal; be precise and safe."] * 600)
    asked = [{"role": "system", "content": long}, {"role": "user", "content": PROMPT}]
    answered = [
        *asked,
        {"role": "assistant", "content": "(the call)"},
        {"role": "user", "content": "<tool_response>\nscripted-hi\n</tool_response>"},
    ]
    for messages, expected in ((asked, CALL_TEXT), (answered, ANSWER_TEXT)):
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        assert len(prompt) > 10_000
        text = generate(model, tokenizer, prompt, max_tokens=8, sampler=make_sampler(0.0))
        assert text == expected


def test_codex_exec_runs_a_tool_call_and_completes_the_turn(
    codex: Path, server: ServerProcess, tmp_path: Path
) -> None:
    with RecordingProxy(server.origin) as proxy:
        ran, events = run_codex(codex, f"{proxy.origin}/lmsp/v1", tmp_path)
    report = f"exit {ran.returncode}\nstdout:\n{ran.stdout}\nstderr:\n{ran.stderr[-3000:]}"
    assert ran.returncode == 0, report

    # Every request Codex sent was accepted.
    exchanges = proxy.exchanges
    assert exchanges, report
    assert [(x.method, x.path, x.status) for x in exchanges if not 200 <= x.status < 300] == []
    turns = [x for x in exchanges if x.method == "POST" and x.path == "/lmsp/v1/responses"]
    assert len(turns) == 2, [(x.method, x.path) for x in exchanges]

    # Codex's own first request: its tools, tool_choice auto, no web search, not stored.
    first, second = turns[0].request, turns[1].request
    assert first["model"] == MODEL and first["stream"] is True and first["store"] is False
    assert first["tool_choice"] == "auto"
    names = {t.get("name") for t in first["tools"]}
    assert CALL_NAME in names
    assert not any(t["type"].startswith("web_search") for t in first["tools"])
    # The model called the shell tool; the turn's answer is text.
    [call] = [i for i in output_items(turns[0]) if i["type"] == "function_call"]
    assert call["name"] == CALL_NAME and json.loads(call["arguments"]) == {"cmd": COMMAND}
    answer = [i for i in output_items(turns[1]) if i["type"] == "message"]
    assert [p["text"] for i in answer for p in i["content"]] == [ANSWER_TEXT]
    assert not [i for i in output_items(turns[1]) if i["type"] == "function_call"]

    # Codex sent the call back with the command's output.
    sent = second["input"]
    [call_back] = [i for i in sent if i.get("type") == "function_call"]
    assert call_back["call_id"] == call["call_id"] and call_back["name"] == CALL_NAME
    [result] = [i for i in sent if i.get("type") == "function_call_output"]
    assert result["call_id"] == call["call_id"]
    assert "scripted-hi" in json.dumps(result["output"])

    # Codex ran the command and completed the turn with the model's answer.
    kinds = [e["type"] for e in events]
    assert kinds[0] == "thread.started" and kinds[-1] == "turn.completed", report
    assert "turn.failed" not in kinds and "error" not in kinds, report
    completed = [e["item"] for e in events if e["type"] == "item.completed"]
    [command] = [i for i in completed if i["type"] == "command_execution"]
    assert "echo scripted-hi" in command["command"]
    assert command["exit_code"] == 0 and command["status"] == "completed"
    assert command["aggregated_output"].strip() == "scripted-hi"
    messages = [i["text"] for i in completed if i["type"] == "agent_message"]
    assert messages == [ANSWER_TEXT]
    # The one error item Codex shows is its own: its model catalogue does not know the model.
    errors = [i["message"] for i in completed if i["type"] == "error"]
    assert all(m.startswith(f"Model metadata for `{MODEL}` not found") for m in errors), errors
