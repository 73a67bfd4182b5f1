"""Jupyter AI against the service (issue 40): a chat message to Jupyternaut answered by LMSP.

Two real servers: LMSP (tests/serverproc.py) serving a "chain" model (tests/chainmodel.py)
whose greedy answer is a known sentence whatever the prompt, and a `jupyter server` of Jupyter
AI's own environment (`make jupyter-ai`, tests/jupyterai.py) configured the way the README tells
a user to: Jupyternaut's default model `openai/<model>`, its `api_base` the service's
`/lmsp/v1`, the token as `OPENAI_API_KEY`.

The test is the chat frontend: it opens the chat's WebSocket (`/api/chat/ws/<path>`, the
transport jupyterlab-chat uses without real-time collaboration), sends a message addressed to
Jupyternaut (`metadata.to_persona`, as the chat input's persona picker stamps it) and waits for
Jupyternaut's reply in the chat. Everything between is Jupyter AI's own code: the router, the
persona manager, Jupyternaut's `process_message` (its langchain agent, with its system prompt
and tools) and LiteLLM's OpenAI provider calling the service's Chat Completions.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from itertools import chain
from typing import Any

import httpx
import pytest
from chainmodel import make_chain_model
from jupyterai import TOKEN as JAI_TOKEN
from jupyterai import JupyterAIServer, require_jupyter_ai
from serverproc import TOKEN, ServerProcess
from websockets.sync.client import ClientConnection, connect

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MODEL = "chain"
ANSWER_PARTS = ["Hello", " from", " the", " local", " model."]
ANSWER = "".join(ANSWER_PARTS)
CHAT = "lmsp.chat"
CONTEXT = 65536


@pytest.fixture(scope="module")
def lmsp(tmp_path_factory) -> Iterator[ServerProcess]:
    require_jupyter_ai()
    root = tmp_path_factory.mktemp("lmsp")
    model = make_chain_model(root / "models" / MODEL, ANSWER_PARTS)
    # Jupyternaut's system prompt and tool schemas come to some 20,000 of the test tokenizer's
    # tokens: a context window to hold them (the chain's answer does not depend on it).
    for name, key in (
        ("config.json", "max_position_embeddings"),
        ("tokenizer_config.json", "model_max_length"),
    ):
        settings = json.loads((model / name).read_text())
        settings[key] = CONTEXT
        (model / name).write_text(json.dumps(settings))
    with ServerProcess(root, default_model=MODEL) as server:
        yield server


@pytest.fixture(scope="module")
def jupyter_ai(lmsp, tmp_path_factory) -> Iterator[JupyterAIServer]:
    model_id = f"openai/{MODEL}"
    config = {
        "JupyternautExtension": {
            "initial_language_model": model_id,
            "model_parameters": {
                model_id: {
                    "api_base": lmsp.api,
                    # Jupyternaut's defaults otherwise, its Anthropic-style `cache_control`
                    # mark on the system message included (accepted, no effect).
                    "temperature": 0,
                }
            },
        }
    }
    home = tmp_path_factory.mktemp("jupyter-ai")
    with JupyterAIServer(home, config, {"OPENAI_API_KEY": TOKEN}) as server:
        yield server


def frames(ws: ClientConnection, deadline: float) -> Iterator[dict[str, Any]]:
    while (left := deadline - time.monotonic()) > 0:
        try:
            yield json.loads(ws.recv(timeout=left))
        except TimeoutError:
            return


def jupyternaut_id(ws: ClientConnection, users: dict[str, Any], deadline: float) -> str:
    """The Jupyternaut persona's user name, from the connection frame's users or the `users`
    updates that follow it (the persona manager joins the chat when it opens)."""
    for frame in chain([{"action": "users", "users": users}], frames(ws, deadline)):
        for name in frame.get("users", {}) if frame.get("action") == "users" else ():
            if name.endswith("::JupyternautPersona"):
                return str(name)
    raise AssertionError("Jupyternaut never joined the chat")


def test_jupyternaut_answers_from_lmsp(jupyter_ai, lmsp):
    url = f"ws://127.0.0.1:{jupyter_ai.port}/api/chat/ws/{CHAT}?token={JAI_TOKEN}"
    # The chat file first, as JupyterLab's "New Chat" makes it (through the contents API).
    r = httpx.put(
        f"{jupyter_ai.origin}/api/contents/{CHAT}",
        params={"token": JAI_TOKEN},
        json={"type": "file", "format": "text", "content": ""},
        timeout=30,
    )
    assert r.status_code in (200, 201), r.text
    deadline = time.monotonic() + 120
    with connect(url, open_timeout=30) as ws:
        hello = json.loads(ws.recv(timeout=30))
        assert hello["action"] == "connection", hello
        persona = jupyternaut_id(ws, hello["users"], deadline)
        ws.send(
            json.dumps(
                {
                    "type": "client",
                    "action": "send",
                    "id": str(uuid.uuid4()),
                    "body": "Say hello.",
                    "metadata": {"to_persona": persona},
                }
            )
        )
        replies: dict[str, str] = {}
        for frame in frames(ws, deadline):
            message = frame.get("message") if frame.get("action") == "message" else None
            if message and message.get("sender") == persona:
                replies[message["id"]] = message.get("body", "")
                if ANSWER in replies.values() or replies[message["id"]].startswith("Error"):
                    break
    assert list(replies.values()) == [ANSWER], f"{replies}\n{jupyter_ai.log()}"
