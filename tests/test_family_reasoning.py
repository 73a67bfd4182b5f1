"""Issue 37's "must show", first part: a scripted response with thinking and a tool call comes out
as a `reasoning` item plus a `function_call` (Responses) and `reasoning_content` plus
`tool_calls` (Chat), streamed and not, for the families whose scripts tests/familymodels.py
writes (qwen3_coder, mistral, kimi_k2); every streamed event validates against the openai SDK.
Not yet covered: the other families of
engine/callformats.py, kill -9 and resume."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from familymodels import chat_template, family_script
from scriptedmodel import CALL_ARGUMENTS, CALL_NAME, make_scripted_model
from sdkserver import MODEL, sdk_server

pytestmark = pytest.mark.timeout(300)

# (tests/scriptedmodel.py takes at most 13 distinct tokens: kimi_k2's call is 8 of them.)
THINKING = ("I should", " run it")
SHELL = {
    "type": "function",
    "name": CALL_NAME,
    "description": "Run a command",
    "parameters": {
        "type": "object",
        "properties": {"cmd": {"type": "string"}},
        "required": ["cmd"],
    },
}


@pytest.fixture(scope="module", params=("qwen3_coder", "mistral", "kimi_k2"))
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Any]:
    family = request.param
    script = family_script(family)
    model_dir = make_scripted_model(
        tmp_path_factory.mktemp(f"thinking-{family}"),
        script=("<think>", *THINKING, "</think>", *script.tokens),
        special=("<think>", "</think>", *script.special),
        chat_template=chat_template(family),
    )
    with sdk_server(tmp_path_factory.mktemp(f"server-{family}"), Path(model_dir)) as srv:
        yield srv


def test_thinking_then_a_call_through_both_apis(server: Any) -> None:
    thinking = "".join(THINKING)
    with httpx.Client(base_url=server.api, headers=server.headers, timeout=120) as http:
        body = {
            "model": MODEL,
            "input": "Run it.",
            "tools": [SHELL],
            "temperature": 0,
            "max_output_tokens": 64,
        }
        r = http.post("/responses", json=body)
        assert r.status_code == 200, r.text
        response = r.json()
        assert response["status"] == "completed", json.dumps(response)[:3000]
        kinds = [i["type"] for i in response["output"]]
        assert kinds == ["reasoning", "function_call"], json.dumps(response)[:3000]
        reasoning, call = response["output"]
        assert "".join(c["text"] for c in reasoning["content"]).strip() == thinking
        assert call["name"] == CALL_NAME
        assert json.loads(call["arguments"]) == CALL_ARGUMENTS

        events = []
        with http.stream("POST", "/responses", json={**body, "stream": True}) as s:
            assert s.status_code == 200, s.read()
            for line in s.iter_lines():
                if line.startswith("data:"):
                    events.append(json.loads(line[5:]))
        kinds = [e["type"] for e in events]
        added = [i for i, e in enumerate(events) if e["type"] == "response.output_item.added"]
        assert len(added) == 2, kinds
        assert events[added[0]]["item"]["type"] == "reasoning"
        assert events[added[1]]["item"]["type"] == "function_call"
        assert kinds.index("response.reasoning_text.done") < added[1]
        assert kinds.index("response.function_call_arguments.done") > added[1]

        # Forced: the grammar lets the model think first, then takes the call.
        forced = http.post("/responses", json={**body, "tool_choice": "required"}).json()
        assert forced["status"] == "completed", forced
        assert [i["type"] for i in forced["output"]] == ["reasoning", "function_call"], forced
        assert json.loads(forced["output"][1]["arguments"]) == CALL_ARGUMENTS

        chat_body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Run it."}],
            "tools": [
                {
                    "type": "function",
                    "function": {k: v for k, v in SHELL.items() if k != "type"},
                }
            ],
            "temperature": 0,
            "max_tokens": 64,
        }
        chat = http.post("/chat/completions", json=chat_body)
        assert chat.status_code == 200, chat.text
        choice = chat.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        assert choice["message"]["reasoning_content"].strip() == thinking
        [tool_call] = choice["message"]["tool_calls"]
        assert tool_call["function"]["name"] == CALL_NAME
        assert json.loads(tool_call["function"]["arguments"]) == CALL_ARGUMENTS

        # Streamed chat: reasoning_content deltas, then tool_call deltas.
        chunks = []
        with http.stream("POST", "/chat/completions", json={**chat_body, "stream": True}) as c:
            assert c.status_code == 200, c.read()
            for line in c.iter_lines():
                if line.startswith("data:") and line[5:].strip() != "[DONE]":
                    chunks.append(json.loads(line[5:]))
        deltas = [ch["choices"][0]["delta"] for ch in chunks if ch.get("choices")]
        said = [i for i, d in enumerate(deltas) if d.get("reasoning_content")]
        called = [i for i, d in enumerate(deltas) if d.get("tool_calls")]
        assert said and called and max(said) < min(called), deltas
        assert "".join(deltas[i]["reasoning_content"] for i in said).strip() == thinking

        # Every streamed Responses event is one the openai SDK knows.
        from openai.types.responses import ResponseStreamEvent
        from pydantic import TypeAdapter

        adapter: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
        for event in events:
            adapter.validate_python(event)
