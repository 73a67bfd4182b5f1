"""Issue 37's "must show", for every tool-call family of engine/callformats.py (tests/
familymodels.py `SCRIPTED`): a response with thinking and a tool call comes out as a
`reasoning` item plus a `function_call` (Responses) and `reasoning_content` plus `tool_calls`
(Chat), streamed and not, the events in order (every streamed Responses event validated with
the openai SDK), and forced by a grammar in the family's syntax after free thinking (batched,
for three of them). One server serves a model per family: a context model (tests/
contextmodel.py), which writes a fixed token sequence with repeats (kimi_k3's call writes
`<|open|>` three times).

The same server serves two gpt-oss-shaped models (tests/harmonymodel.py): thinking in the
analysis channel then a call to `functions.NAME`, and a final answer (in a schema when asked).

Then, on that server: a tool whose schema compiles in the generic grammar but not in the
family's (a `$ref` from one parameter to another, compiled alone there) is a 400 at admission
naming the parameter, in both APIs. And thinking-then-call responses of every family and of
harmony, fourteen in flight on one worker, killed (kill -9) in their thinking and resumed, end
as uninterrupted runs (the same reasoning, call and token counts, every event once).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from contextmodel import make_context_model
from familymodels import SCRIPTED, chat_template, family_script, thinking_markers
from harmonymodel import (
    ANSWER,
    CALL_SCRIPT,
    FINAL_SCRIPT,
    OPENED,
    make_harmony_chain,
    make_harmony_model,
)
from harmonymodel import (
    THINKING as HARMONY_THINKING,
)
from scriptedmodel import CALL_ARGUMENTS, CALL_NAME
from serverproc import ServerProcess

pytestmark = pytest.mark.timeout(600)

THINKING = ("I should", " run it")
# The two harmony models the server serves beside the families' (tests/harmonymodel.py).
HARMONY_MODEL, FINAL_MODEL = "gpt-oss", "gpt-oss-final"


def _tool(family: str) -> dict[str, Any]:
    return {
        "type": "function",
        "name": CALL_NAME,
        "description": "Run a command",
        "parameters": family_script(family).parameters,
    }


def _family_model(path: Path, family: str, thinking: tuple[str, ...]) -> Path:
    """A context model (tests/contextmodel.py) that thinks `thinking` between the family's
    thinking markers (`<think>` .. `</think>`; Gemma's and Kimi K3's own multi-token ones), then
    calls `exec_command` in `family`'s format."""
    script = family_script(family)
    markers = thinking_markers(family)
    return make_context_model(
        path,
        (*markers.start, *thinking, *markers.end, *script.tokens),
        special=(*markers.special, *script.special),
        template=chat_template(family),
        extra_tokens=markers.extra,
    )


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    data = tmp_path_factory.mktemp("families-server")
    (data / "models").mkdir()
    root = tmp_path_factory.mktemp("family-models")
    for family in SCRIPTED:
        (data / "models" / family).symlink_to(_family_model(root / family, family, THINKING))
    harmony = make_harmony_model(root / "gpt-oss", CALL_SCRIPT, OPENED)
    (data / "models" / HARMONY_MODEL).symlink_to(harmony)
    (data / "models" / FINAL_MODEL).symlink_to(make_harmony_model(root / "final", FINAL_SCRIPT))
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
    with server.client(timeout=120) as http:
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


@pytest.mark.parametrize("model", ["qwen3_coder", "glm47", HARMONY_MODEL])
def test_thinking_then_a_forced_call_batched(server: ServerProcess, model: str) -> None:
    """Several forced requests at once (rows of one batch, each with its grammar after the
    thinking block): each its reasoning and its call."""
    family = "mistral" if model == HARMONY_MODEL else model
    body = {
        "model": model,
        "input": "Run it.",
        "tools": [_tool(family)],
        "tool_choice": "required",
        "temperature": 0,
        "max_output_tokens": 64,
    }

    def one(_: int) -> dict[str, Any]:
        with server.client(timeout=120) as http:
            return dict(http.post("/responses", json=body).json())

    arguments = CALL_ARGUMENTS if model == HARMONY_MODEL else family_script(model).arguments
    with ThreadPoolExecutor(3) as pool:
        for response in pool.map(one, range(3)):
            assert response["status"] == "completed", response
            assert [i["type"] for i in response["output"]] == ["reasoning", "function_call"]
            assert json.loads(response["output"][1]["arguments"]) == arguments


def test_a_schema_the_family_grammar_cannot_take_is_a_400(server: ServerProcess) -> None:
    """`b` refers to `a`: the generic grammar compiles the arguments schema whole, glm47's each
    parameter alone, where the pointer leads nowhere. Found at admission, not by the worker."""
    parameters = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"$ref": "#/properties/a"}},
        "required": ["a"],
    }
    with server.client(timeout=120) as http:
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


# --- gpt-oss's harmony (engine/harmony.py) -------------------------------------------------

SHELL = _tool("mistral")
CHAT_SHELL = {"type": "function", "function": {k: v for k, v in SHELL.items() if k != "type"}}


def test_harmony_thinking_then_a_call_through_both_apis(server: ServerProcess) -> None:
    """gpt-oss's shape: the template opens the analysis block; the model thinks, then calls
    `functions.exec_command` in a commentary message (tests/harmonymodel.py)."""
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    with server.client(timeout=120) as http:
        body = {
            "model": HARMONY_MODEL,
            "input": "Run it.",
            "tools": [SHELL],
            "temperature": 0,
            "max_output_tokens": 64,
            "reasoning": {"effort": "high"},
        }
        for forced in (False, True):
            asked = {**body, "tool_choice": "required"} if forced else body
            r = http.post("/responses", json=asked)
            assert r.status_code == 200, r.text
            response = r.json()
            assert response["status"] == "completed", json.dumps(response)[:3000]
            assert [i["type"] for i in response["output"]] == ["reasoning", "function_call"]
            reasoning, call = response["output"]
            assert "".join(c["text"] for c in reasoning["content"]) == HARMONY_THINKING
            assert (call["name"], json.loads(call["arguments"])) == (CALL_NAME, CALL_ARGUMENTS)
            assert response["usage"]["output_tokens_details"]["reasoning_tokens"] >= 2
            assert "<|" not in json.dumps(response["output"])

        events = _sse(http, "/responses", body)
        kinds = [e["type"] for e in events]
        added = [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"]
        assert added == ["reasoning", "function_call"], kinds
        assert kinds.index("response.reasoning_text.done") < kinds.index(
            "response.function_call_arguments.done"
        )
        adapter: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
        for event in events:
            adapter.validate_python(event)

        chat_body = {
            "model": HARMONY_MODEL,
            "messages": [{"role": "user", "content": "Run it."}],
            "tools": [CHAT_SHELL],
            "temperature": 0,
            "max_tokens": 64,
            "reasoning_effort": "low",
        }
        chat = http.post("/chat/completions", json=chat_body)
        assert chat.status_code == 200, chat.text
        choice = chat.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        assert choice["message"]["reasoning_content"] == HARMONY_THINKING
        assert not choice["message"].get("content")
        [tool_call] = choice["message"]["tool_calls"]
        assert json.loads(tool_call["function"]["arguments"]) == CALL_ARGUMENTS
        deltas = [c["choices"][0]["delta"] for c in _sse(http, "/chat/completions", chat_body)]
        said = [i for i, d in enumerate(deltas) if d.get("reasoning_content")]
        called = [i for i, d in enumerate(deltas) if d.get("tool_calls")]
        assert said and called and max(said) < min(called), deltas


def test_harmony_final_answer_and_structured_output(server: ServerProcess) -> None:
    """A harmony model that answers in a final message straight away: the message's text
    only (no markers, no reasoning), in the schema when one is asked for."""
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "integer"}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    fmt = {"format": {"type": "json_schema", "name": "a", "schema": schema, "strict": True}}
    with server.client(timeout=120) as http:
        base = {"model": FINAL_MODEL, "input": "Answer.", "temperature": 0, "max_output_tokens": 32}
        for body in (base, {**base, "text": fmt}, {**base, "tools": [SHELL]}):
            r = http.post("/responses", json=body)
            assert r.status_code == 200, r.text
            response = r.json()
            assert response["status"] == "completed", response
            assert [i["type"] for i in response["output"]] == ["message"], response
            [part] = response["output"][0]["content"]
            assert part["text"] == ANSWER, response
        events = _sse(http, "/responses", base)
        deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
        assert "".join(deltas) == ANSWER
        chat = http.post(
            "/chat/completions",
            json={
                "model": FINAL_MODEL,
                "messages": [{"role": "user", "content": "Answer."}],
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "a", "schema": schema, "strict": True},
                },
                "max_tokens": 32,
            },
        )
        assert chat.status_code == 200, chat.text
        message = chat.json()["choices"][0]["message"]
        assert message["content"] == ANSWER and not message.get("reasoning_content")

        # A custom tool has no place in harmony: refused, naming it.
        custom = {"type": "custom", "name": "patch", "description": "A patch"}
        r = http.post("/responses", json={**base, "tools": [custom]})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "tools[0].type" and "harmony" in error["message"], error


# --- kill -9 and resume ----------------------------------------------------------------------

# Every family's model thinks in 16 tokens, then calls in its format; harmony's (a chain model,
# tests/chainmodel.py: its template opens the analysis block, so the thinking needs no start
# marker) thinks the same words, then calls. All fourteen run at once on one worker: it keeps any
# number of models loaded while their weights fit `max_loaded_bytes` (by default half the
# machine's memory; these take well under a megabyte each) and steps every loaded model's batch
# in turn, `max_batch_size` rows in all (8 by default: 16 here).
WORDS = tuple(f" w{i}" for i in range(16))
CHAINS = {
    **{
        family: (
            *thinking_markers(family).start,
            *WORDS,
            *thinking_markers(family).end,
            *family_script(family).tokens,
        )
        for family in SCRIPTED
    },
    HARMONY_MODEL: (*WORDS, *CALL_SCRIPT[1:]),
}
ROWS = {"max_batch_size": 16}


@pytest.mark.slow
def test_thinking_then_a_call_resumed_after_kill(tmp_path: Path) -> None:
    """Responses of every family, in flight together, killed (kill -9) in their thinking and
    resumed by the next server: each ends as an uninterrupted run would."""
    from test_crash_recovery import SLOW, TERMINAL, check_log, create, read_sse, wait_for

    data = tmp_path / "data"
    (data / "models").mkdir(parents=True)
    for model in CHAINS:
        if model == HARMONY_MODEL:
            made = make_harmony_chain(tmp_path / model, CHAINS[model], OPENED)
        else:
            made = _family_model(tmp_path / model, model, WORDS)
        (data / "models" / model).symlink_to(made)

    def thinking(task: dict[str, Any], log: list[dict[str, Any]]) -> bool:
        deltas = [e for e in log if e["type"] == "response.reasoning_text.delta"]
        return len("".join(e["delta"] for e in deltas)) >= 12

    # Slow enough that every one is in its thinking at the kill (the last created must get
    # there before the first has thought its 16 tokens).
    slow: dict[str, Any] = {**SLOW, "engine_token_delay": 0.4, **ROWS}
    server = ServerProcess(data, default_model="mistral", name="0", **slow).start()
    try:
        tasks, seen = {}, {}
        with server.client() as c:

            def warm(model: str) -> int:
                family = "mistral" if model == HARMONY_MODEL else model
                body = {
                    "model": model,
                    "input": "Hi",
                    "max_output_tokens": 1,
                    "tools": [_tool(family)],
                }
                with server.client() as each:
                    return each.post("/responses", json=body).status_code

            # Each model loaded first, its tool grammar compiled (and cached) too: a create that
            # waits for either lets the ones before it run to their end (make test under load:
            # a create's compile outlasted another's whole run). All at once: one at a time
            # takes a few steps of 0.4 s each.
            with ThreadPoolExecutor(len(CHAINS)) as pool:
                assert set(pool.map(warm, CHAINS)) == {200}
            for model in CHAINS:
                family = "mistral" if model == HARMONY_MODEL else model
                tasks[model] = create(
                    c,
                    model=model,
                    temperature=0,
                    on_restart="resume",
                    tools=[_tool(family)],
                    max_output_tokens=64,
                )["task_id"]
            for model, task_id in tasks.items():
                seen[model] = wait_for(c, task_id, thinking)[1]
        server.kill()
        # (The next server only finishes what was killed: at full speed.)
        server = ServerProcess(data, default_model="mistral", name="1", **ROWS).start()
        for model, task_id in tasks.items():
            _check_resumed(server, model, task_id, seen[model], TERMINAL, check_log, read_sse)
    finally:
        # Also when a check fails: a server left running would be collected, still running, in
        # a later test of this worker (a ResourceWarning, an error there).
        server.stop()


def _check_resumed(
    server: ServerProcess,
    model: str,
    task_id: str,
    before: list[dict[str, Any]],
    terminal: set[str],
    check_log: Any,
    read_sse: Any,
) -> None:
    assert not any(e["type"] in terminal for e in before), f"{model} ended before the kill"
    done = "response.reasoning_text.done"
    assert not any(e["type"] == done for e in before), f"{model} had thought before the kill"
    rest = read_sse(server, f"/tasks/{task_id}/events", before[-1]["sequence_number"])
    log = before + rest
    final = check_log(log)["response"]
    assert final["status"] == "completed", (model, final)
    assert [i["type"] for i in final["output"]] == ["reasoning", "function_call"], (model, final)
    reasoning, call = final["output"]
    thought = "".join(c["text"] for c in reasoning["content"])
    assert thought.strip() == "".join(WORDS).strip(), model
    arguments = CALL_ARGUMENTS if model == HARMONY_MODEL else family_script(model).arguments
    assert (call["name"], json.loads(call["arguments"])) == (CALL_NAME, arguments), model
    # Every delta once: the streamed thinking across the kill is the whole thinking.
    deltas = [e["delta"] for e in log if e["type"] == "response.reasoning_text.delta"]
    assert "".join(deltas) == thought, model
    # As many tokens as the chain (harmony's last, `<|call|>`, ends the output: an
    # end-of-sequence token is not counted), its thinking markers counted as reasoning
    # (harmony's start marker is the prompt's).
    usage = final["usage"]
    harmony = model == HARMONY_MODEL
    assert usage["output_tokens"] == len(CHAINS[model]) - harmony, (model, usage)
    reasoning_tokens = len(WORDS) + (
        1 if harmony else len(thinking_markers(model).start) + len(thinking_markers(model).end)
    )
    assert usage["output_tokens_details"]["reasoning_tokens"] == reasoning_tokens, model
