"""Crash tests for constrained, tool-calling and stopping generations (issues 14 and 15): a real
server killed with SIGKILL mid-generation and started again on the same database.

A `resume` task continues from its last commit and must end exactly as an uninterrupted run of
the same request does (its text, its function calls, its log-probabilities); a `retry` task
starts over and must still end valid. Each case runs alone on its server, as the reference
does: the comparison is of the same computation, interrupted or not.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from serverproc import ServerProcess
from test_crash_recovery import (
    SLOW,
    TERMINAL,
    check_log,
    create,
    events,
    finished,
    read_sse,
    wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"],
    "additionalProperties": False,
}
# Commands of a small shell language: long enough to be cut by the kill.
SHELL_LARK = """start: cmd (" && " cmd){3,5}
cmd: VERB " " WORD
VERB: "ls" | "cat" | "echo"
WORD: /[a-z]{4,12}/
"""
SHELL_RE = re.compile(r"(ls|cat|echo) [a-z]{4,12}( && (ls|cat|echo) [a-z]{4,12}){3,5}")
CASES: dict[str, dict[str, Any]] = {
    "schema": {
        "text": {"format": {"type": "json_schema", "name": "p", "schema": PERSON, "strict": True}},
        "max_output_tokens": 400,
    },
    "tool": {
        "tools": [{"type": "function", "name": "get_weather", "parameters": WEATHER}],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_output_tokens": 400,
    },
    # A custom tool whose input is a sentence of a Lark grammar (issue 36).
    "custom": {
        "tools": [
            {
                "type": "custom",
                "name": "shell",
                "format": {"type": "grammar", "syntax": "lark", "definition": SHELL_LARK},
            }
        ],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_output_tokens": 400,
    },
    "stop": {
        "max_output_tokens": 120,
        "include": ["message.output_text.logprobs"],
        "top_logprobs": 2,
    },
}
# Events that carry generated output.
GROWS = {
    "response.output_text.delta",
    "response.function_call_arguments.delta",
    "response.custom_tool_call_input.delta",
}


def grown(log: list[dict[str, Any]]) -> int:
    return sum(e["type"] in GROWS for e in log)


def reference_server(lmsp_data: Path) -> ServerProcess:
    """A server of its own on the same model, for the uninterrupted run."""
    ref = lmsp_data / "ref"
    (ref / "models").mkdir(parents=True)
    (ref / "models" / "tiny").symlink_to((lmsp_data / "models" / "tiny").resolve())
    return ServerProcess(ref)


def outcome(final: dict[str, Any]) -> list[tuple[Any, ...]]:
    """A response's output, without the ids (they are made of the response's own id)."""
    out: list[tuple[Any, ...]] = []
    for item in final["output"]:
        if item["type"] == "message":
            part = item["content"][0]
            tokens = [
                (e["token"], [t["token"] for t in e["top_logprobs"]]) for e in part["logprobs"]
            ]
            out.append(("message", item["status"], part["text"], tokens, part["logprobs"]))
        elif item["type"] == "custom_tool_call":
            out.append(("custom_tool_call", item["status"], item["name"], item["input"], []))
        else:
            out.append(("function_call", item["status"], item["name"], item["arguments"], []))
    return out


def values(logprobs: list[dict[str, Any]]) -> list[float]:
    return [v for e in logprobs for v in (e["logprob"], *(t["logprob"] for t in e["top_logprobs"]))]


def check_valid(case: str, final: dict[str, Any]) -> None:
    if case == "schema":
        jsonschema.validate(json.loads(final["output"][0]["content"][0]["text"]), PERSON)
    elif case == "tool":
        calls = [item for item in final["output"] if item["type"] == "function_call"]
        assert calls and all(call["status"] == "completed" for call in calls)
        for call in calls:
            jsonschema.validate(json.loads(call["arguments"]), WEATHER)
    elif case == "custom":
        [call] = final["output"]
        assert call["type"] == "custom_tool_call" and call["status"] == "completed"
        assert SHELL_RE.fullmatch(call["input"]), call["input"]


@pytest.mark.parametrize("case", list(CASES))
def test_resume_after_kill_ends_as_the_uninterrupted_run(lmsp_data, case):
    request: dict[str, Any] = {
        "temperature": 0.8,
        "seed": 99,
        "on_restart": "resume",
        **CASES[case],
    }
    with reference_server(lmsp_data).start() as ref, ref.client() as c:
        if case == "stop":
            # A stop sequence that first appears well into the text, past where the kill is.
            _, log = wait_for(c, create(c, **request)["task_id"], finished)
            text = check_log(log)["response"]["output"][0]["content"][0]["text"]
            at = next(i for i in range(40, len(text) - 3) if text[i : i + 3].isascii())
            request["stop"] = [text[at : at + 3], "never-there"]
        _, ref_log = wait_for(c, create(c, **request)["task_id"], finished)
        expected = check_log(ref_log)["response"]
    check_valid(case, expected)
    if case == "stop":
        assert expected["status"] == "completed"
        assert request["stop"][0] not in expected["output"][0]["content"][0]["text"]

    server = ServerProcess(lmsp_data, **SLOW).start()
    with server.client() as c:
        resp = create(c, **request)
        _, seen = wait_for(c, resp["task_id"], lambda t, log: grown(log) >= 5)
    server.kill()
    assert not any(e["type"] in TERMINAL for e in seen), "it finished before the kill"

    with ServerProcess(lmsp_data).start() as server2, server2.client() as c:
        rest = read_sse(server2, f"/tasks/{resp['task_id']}/events", seen[-1]["sequence_number"])
        whole = seen + rest
        final = check_log(whole)["response"]
        assert final["status"] == expected["status"]
        got, want = outcome(final), outcome(expected)
        assert [o[:4] for o in got] == [o[:4] for o in want]
        # Log-probabilities: the same tokens and alternatives; the values as the resumed run's
        # prefill computes them (the last bits of a float may differ from decoding's).
        for g, w in zip(got, want, strict=True):
            assert values(g[4]) == pytest.approx(values(w[4]), abs=1e-4)
        assert final["usage"]["output_tokens"] == expected["usage"]["output_tokens"]
        # The stored log is the one streamed, and the deltas add up to the output.
        assert events(c, resp["task_id"]) == whole
        streamed = "".join(e["delta"] for e in whole if e["type"] in GROWS)
        made = "".join(
            item["content"][0]["text"]
            if item["type"] == "message"
            else item["input"]
            if item["type"] == "custom_tool_call"
            else item["arguments"]
            for item in final["output"]
        )
        assert streamed == made


@pytest.mark.parametrize("case", ["schema", "tool"])
def test_retry_after_kill_ends_valid(lmsp_data, case):
    server = ServerProcess(lmsp_data, **SLOW).start()
    with server.client() as c:
        resp = create(c, on_restart="retry", temperature=0.8, **CASES[case])
        wait_for(c, resp["task_id"], lambda t, log: grown(log) >= 5)
    server.kill()
    with ServerProcess(lmsp_data).start() as server2, server2.client() as c:
        task, log = wait_for(c, resp["task_id"], finished)
        final = check_log(log)["response"]
        assert task["state"] == "completed" and final["status"] == "completed"
        assert "response.queued" in [e["type"] for e in log]
        # Only the second attempt's items are the response's output, and they are valid.
        check_valid(case, final)
        interrupted = [
            e["item"]["id"]
            for e in log
            if e["type"] == "response.output_item.done" and e["item"]["status"] == "incomplete"
        ]
        assert interrupted
        assert not {item["id"] for item in final["output"]} & set(interrupted)
