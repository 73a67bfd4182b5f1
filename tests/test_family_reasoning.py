"""Issue 37's "must show", for every tool-call family a scripted model can write (tests/
familymodels.py `SCRIPTED`: all of engine/callformats.py but kimi_k3, whose markers repeat
within a call): a response with thinking and a tool call comes out as a `reasoning` item plus a
`function_call` (Responses) and `reasoning_content` plus `tool_calls` (Chat), streamed and not,
the events in order (every streamed Responses event validated with the openai SDK), and forced
by a grammar in the family's syntax after free thinking. One server serves a model per family.

Then, on that server: a tool whose schema compiles in the generic grammar but not in the
family's (a `$ref` from one parameter to another, compiled alone there) is a 400 at admission
naming the parameter, in both APIs. And a thinking-then-call response killed (kill -9) in its
thinking and resumed ends as an uninterrupted run: the same reasoning, call and token counts,
every event once.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from chainmodel import make_chain_model
from familymodels import SCRIPTED, chat_template, family_script
from scriptedmodel import CALL_ARGUMENTS, CALL_NAME, make_scripted_model
from serverproc import ServerProcess

pytestmark = pytest.mark.timeout(600)

# (tests/scriptedmodel.py takes at most 13 distinct tokens: glm47's call is 9 of them.)
THINKING = ("I should", " run it")


def _tool(family: str) -> dict[str, Any]:
    return {
        "type": "function",
        "name": CALL_NAME,
        "description": "Run a command",
        "parameters": family_script(family).parameters,
    }


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    data = tmp_path_factory.mktemp("families-server")
    (data / "models").mkdir()
    root = tmp_path_factory.mktemp("family-models")
    for family in SCRIPTED:
        script = family_script(family)
        model_dir = make_scripted_model(
            root / family,
            script=("<think>", *THINKING, "</think>", *script.tokens),
            special=("<think>", "</think>", *script.special),
            chat_template=chat_template(family),
        )
        (data / "models" / family).symlink_to(model_dir)
    with ServerProcess(data, default_model=SCRIPTED[0]).start() as srv:
        yield srv


def _sse(http: httpx.Client, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                out.append(json.loads(line[5:]))
    return out


@pytest.mark.parametrize("family", SCRIPTED)
def test_thinking_then_a_call_through_both_apis(server: ServerProcess, family: str) -> None:
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    thinking = "".join(THINKING)
    arguments = family_script(family).arguments
    tool = _tool(family)
    with httpx.Client(base_url=server.api, headers=server.headers, timeout=120) as http:
        body = {
            "model": family,
            "input": "Run it.",
            "tools": [tool],
            "temperature": 0,
            "max_output_tokens": 64,
        }
        # Free, then forced: the grammar lets the model think first, then takes the call.
        for asked in (body, {**body, "tool_choice": "required"}):
            r = http.post("/responses", json=asked)
            assert r.status_code == 200, r.text
            response = r.json()
            assert response["status"] == "completed", json.dumps(response)[:3000]
            kinds = [i["type"] for i in response["output"]]
            assert kinds == ["reasoning", "function_call"], json.dumps(response)[:3000]
            reasoning, call = response["output"]
            assert "".join(c["text"] for c in reasoning["content"]).strip() == thinking
            assert (call["name"], json.loads(call["arguments"])) == (CALL_NAME, arguments)

        events = _sse(http, "/responses", body)
        kinds = [e["type"] for e in events]
        added = [i for i, e in enumerate(events) if e["type"] == "response.output_item.added"]
        assert [events[i]["item"]["type"] for i in added] == ["reasoning", "function_call"]
        assert kinds.index("response.reasoning_text.done") < added[1]
        assert kinds.index("response.function_call_arguments.done") > added[1]
        adapter: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
        for event in events:
            adapter.validate_python(event)

        chat_body = {
            "model": family,
            "messages": [{"role": "user", "content": "Run it."}],
            "tools": [
                {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}
            ],
            "temperature": 0,
            "max_tokens": 64,
        }
        chat = http.post("/chat/completions", json=chat_body)
        assert chat.status_code == 200, chat.text
        choice = chat.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        assert choice["message"]["reasoning_content"].strip() == thinking
        assert not choice["message"].get("content"), choice
        [tool_call] = choice["message"]["tool_calls"]
        assert tool_call["function"]["name"] == CALL_NAME
        assert json.loads(tool_call["function"]["arguments"]) == arguments

        # Streamed chat: reasoning_content deltas, then tool_call deltas.
        deltas = [c["choices"][0]["delta"] for c in _sse(http, "/chat/completions", chat_body)]
        said = [i for i, d in enumerate(deltas) if d.get("reasoning_content")]
        called = [i for i, d in enumerate(deltas) if d.get("tool_calls")]
        assert said and called and max(said) < min(called), deltas
        assert "".join(deltas[i]["reasoning_content"] for i in said).strip() == thinking


def test_a_schema_the_family_grammar_cannot_take_is_a_400(server: ServerProcess) -> None:
    """`b` refers to `a`: the generic grammar compiles the arguments schema whole, glm47's each
    parameter alone, where the pointer leads nowhere. Found at admission, not by the worker."""
    parameters = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"$ref": "#/properties/a"}},
        "required": ["a"],
    }
    with httpx.Client(base_url=server.api, headers=server.headers, timeout=120) as http:
        r = http.post(
            "/responses",
            json={
                "model": "glm47",
                "input": "Go.",
                "tools": [{"type": "function", "name": "f", "parameters": parameters}],
            },
        )
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "tools[0].parameters.properties.b", error
        assert "glm47" in error["message"] and "/properties/a" in error["message"], error
        r = http.post(
            "/chat/completions",
            json={
                "model": "glm47",
                "messages": [{"role": "user", "content": "Go."}],
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": parameters}}
                ],
            },
        )
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "tools[0].function.parameters.properties.b"
        # The same tool for a model in the generic shape's format is taken.
        r = http.post(
            "/responses",
            json={
                "model": "mistral",
                "input": "Go.",
                "tools": [{"type": "function", "name": "f", "parameters": parameters}],
                "max_output_tokens": 1,
            },
        )
        assert r.status_code == 200, r.text


# --- kill -9 and resume ----------------------------------------------------------------------

# A chain model (tests/chainmodel.py: distinct texts, up to 31) thinks in 20 tokens, then calls
# in mistral's format.
WORDS = tuple(f" w{i}" for i in range(20))
CHAIN = (
    "<think>",
    *WORDS,
    "</think>",
    "[TOOL_CALLS]",
    CALL_NAME,
    "[ARGS]",
    json.dumps(CALL_ARGUMENTS),
)


@pytest.mark.slow
def test_thinking_then_a_call_resumed_after_kill(tmp_path: Path) -> None:
    from test_crash_recovery import SLOW, TERMINAL, check_log, create, read_sse, wait_for

    data = tmp_path / "data"
    (data / "models").mkdir(parents=True)
    model = make_chain_model(tmp_path / "model", CHAIN, template=chat_template("mistral"))
    (data / "models" / "mistral").symlink_to(model)
    request: dict[str, Any] = {
        "model": "mistral",
        "temperature": 0,
        "on_restart": "resume",
        "tools": [_tool("mistral")],
        "max_output_tokens": 64,
    }
    server = ServerProcess(data, default_model="mistral", **SLOW).start()
    with server.client() as c:
        resp = create(c, **request)

        def thinking(task: dict[str, Any], log: list[dict[str, Any]]) -> bool:
            deltas = [e for e in log if e["type"] == "response.reasoning_text.delta"]
            return len("".join(e["delta"] for e in deltas)) >= 12

        _, seen = wait_for(c, resp["task_id"], thinking)
    server.kill()
    assert not any(e["type"] in TERMINAL for e in seen), "it finished before the kill"
    assert not any(e["type"] == "response.function_call_arguments.done" for e in seen)
    with ServerProcess(data, default_model="mistral").start() as server2:
        rest = read_sse(server2, f"/tasks/{resp['task_id']}/events", seen[-1]["sequence_number"])
    log = seen + rest
    final = check_log(log)["response"]
    assert final["status"] == "completed", final
    assert [i["type"] for i in final["output"]] == ["reasoning", "function_call"], final
    reasoning, call = final["output"]
    assert "".join(c["text"] for c in reasoning["content"]) == "".join(WORDS)
    assert (call["name"], json.loads(call["arguments"])) == (CALL_NAME, CALL_ARGUMENTS)
    # Every delta once: the streamed thinking across the kill is the whole thinking.
    deltas = [e["delta"] for e in log if e["type"] == "response.reasoning_text.delta"]
    assert "".join(deltas) == "".join(WORDS)
    usage = final["usage"]
    assert usage["output_tokens"] == len(CHAIN), usage
    assert usage["output_tokens_details"]["reasoning_tokens"] == len(WORDS) + 2, usage
