"""Custom tools of the Responses API (issue 36): a tool whose input is text, free or a sentence of
a Lark or regex grammar that llguidance enforces token by token.

Engine level: the call grammar accepts exactly the grammar's sentences (and function calls
beside them), the parser streams a custom call's input whatever the chunking, and the prompt
shows the tools and past calls as the model writes them. On a real server with the random test
model: a forced call streams `response.custom_tool_call_input.delta`/`.done` (checked with the
openai SDK's own event and item types), its input is a sentence of the grammar alone and in a
batch of concurrent requests, a cut-off call closes its input before its item, a call sent back
with its `custom_tool_call_output` continues the conversation (as input items and through
`previous_response_id`), and what cannot be compiled or does not fit is a 400 saying where.
The resume after kill -9 is a case of tests/test_crash_features.py.
"""

from __future__ import annotations

import json
import random
import re
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import ResponseCustomToolCall, ResponseStreamEvent
from pydantic import TypeAdapter
from sdkserver import MODEL, TOKEN, sdk_server
from serverproc import ServerProcess
from test_strict_tools import accepts

from jupyter_lmsp.engine.grammars import (
    GENERIC,
    CallFormat,
    CustomTool,
    FunctionTool,
    ToolSpec,
    build_grammar,
    check_tools,
)
from jupyter_lmsp.engine.toolcalls import (
    ArgumentsDelta,
    CallDone,
    CallStart,
    ContentDelta,
    ToolCallParser,
    render,
)

pytestmark = pytest.mark.timeout(240)

# A small shell language, and the same language as a Python regex to check sentences with.
SHELL_LARK = """start: cmd (" && " cmd){0,2}
cmd: VERB " " WORD
VERB: "ls" | "cat" | "echo"
WORD: /[a-z]{1,6}/
"""
SHELL_RE = re.compile(r"(ls|cat|echo) [a-z]{1,6}( && (ls|cat|echo) [a-z]{1,6}){0,2}")
ZIP_REGEX = r"[0-9]{5}(-[0-9]{4})?"

SHELL_TOOL = {
    "type": "custom",
    "name": "shell",
    "description": "Run a shell command",
    "format": {"type": "grammar", "syntax": "lark", "definition": SHELL_LARK},
}
ZIP_TOOL = {
    "type": "custom",
    "name": "zip_code",
    "format": {"type": "grammar", "syntax": "regex", "definition": ZIP_REGEX},
}
NOTE_TOOL = {"type": "custom", "name": "note", "description": "Take a note"}
WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Oslo", "Paris"]}},
        "required": ["city"],
    },
}
ASK = [{"role": "user", "content": "List the files."}]
EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)


def written(name: str, text: str) -> str:
    return f'<tool_call>\n{{"name": "{name}"}}\n{text}\n</tool_call>'


# -- the grammar ------------------------------------------------------------------------------

ENGINE_SPEC = ToolSpec(
    (FunctionTool("get_weather", None, WEATHER_TOOL["parameters"]),),  # type: ignore[arg-type]
    "auto",
    True,
    None,
    (
        CustomTool("shell", None, "lark", SHELL_LARK),
        CustomTool("zip_code", None, "regex", ZIP_REGEX),
        CustomTool("note"),
    ),
)


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        (written("shell", "ls src && cat notes"), True),
        (written("shell", "rm src"), False),
        (written("shell", "ls src && "), False),
        (written("zip_code", "12345-6789"), True),
        (written("zip_code", "1234"), False),
        (written("note", "any text\nover lines"), True),
        ("Plain text, no call.", True),
        (
            "Let me look.\n" + written("zip_code", "10001") + "\n" + written("shell", "echo hi"),
            True,
        ),
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>', True),
        (written("get_weather", "Oslo"), False),
        ('<tool_call>\n{"name": "shell", "arguments": {}}\n</tool_call>', False),
    ],
)
def test_the_call_grammar_takes_exactly_the_sentences(tokenizer, text, ok):
    assert check_tools(ENGINE_SPEC) is None
    grammar = build_grammar(None, ENGINE_SPEC)
    assert grammar is not None
    assert accepts(tokenizer, grammar, text) is ok


def test_a_forced_custom_call_and_one_call_only(tokenizer):
    forced = ToolSpec((), "shell", False, None, ENGINE_SPEC.customs)
    grammar = build_grammar(None, forced)
    assert grammar is not None
    assert accepts(tokenizer, grammar, written("shell", "ls a"))
    assert not accepts(tokenizer, grammar, "Sure. " + written("shell", "ls a"))
    assert not accepts(tokenizer, grammar, written("zip_code", "12345"))
    two = written("shell", "ls a") + "\n" + written("shell", "ls b")
    assert not accepts(tokenizer, grammar, two)
    parallel = ToolSpec((), "required", True, None, ENGINE_SPEC.customs)
    assert accepts(tokenizer, build_grammar(None, parallel) or "", two)


@pytest.mark.parametrize(
    ("syntax", "definition", "reason"),
    [
        ("lark", "start: (((", "Expected token"),
        ("regex", "(?<=a)b", "look-around"),
        ("lark", "  ", "must not be empty"),
    ],
)
def test_a_grammar_that_cannot_compile_is_found_before_any_work(syntax, definition, reason):
    spec = ToolSpec((), "auto", True, None, (CustomTool("bad", None, syntax, definition),))
    issue = check_tools(spec)
    assert issue is not None and reason in issue.reason
    assert issue.path == ("tools", 0, "format", "definition")


# -- parsing and rendering ----------------------------------------------------------------------

STREAMED = (
    "Sure.\n"
    + written("shell", "ls a\n&& cat </tool")
    + "\n"
    + '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    + "\n"
    + written("note", "")
)


@pytest.mark.parametrize("seed", range(20))
def test_the_parser_streams_a_custom_input_whatever_the_chunking(seed):
    rng = random.Random(seed)
    parser = ToolCallParser(names={"get_weather"}, customs={"shell", "note"})
    events: list[Any] = []
    at = 0
    while at < len(STREAMED):
        step = rng.randint(1, 7)
        events += parser.feed(STREAMED[at : at + step])
        at += step
    events += parser.finish()
    done = [e for e in events if isinstance(e, CallDone)]
    assert [(d.name, d.arguments, d.custom) for d in done] == [
        ("shell", "ls a\n&& cat </tool", True),
        ("get_weather", '{"city": "Oslo"}', False),
        ("note", "", True),
    ]
    starts = [(e.name, e.custom) for e in events if isinstance(e, CallStart)]
    assert starts == [("shell", True), ("get_weather", False), ("note", True)]
    for call in done:
        deltas = [
            e.delta for e in events if isinstance(e, ArgumentsDelta) and e.index == call.index
        ]
        assert "".join(deltas) == call.arguments
    assert "".join(e.text for e in events if isinstance(e, ContentDelta)) == "Sure.\n"


def test_a_custom_call_of_an_unknown_tool_fails_loudly():
    parser = ToolCallParser(customs={"shell"})
    with pytest.raises(ValueError, match="names no custom tool"):
        parser.feed(written("zip_code", "12345"))


HISTORY = [
    {"role": "user", "content": "List the files."},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call_1", "name": "shell", "input": "ls src"},
            {"id": "call_2", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "main.py", "custom": True},
    {"role": "tool", "tool_call_id": "call_2", "content": "sunny"},
]


@pytest.mark.parametrize("call_format", [GENERIC, CallFormat("json_tools")])
def test_past_custom_calls_are_shown_as_the_model_writes_them(call_format):
    messages, extra = render(HISTORY, ENGINE_SPEC, call_format)
    system = messages[0]
    assert system["role"] == "system"
    assert (
        "# Custom tools" in system["content"]
        and SHELL_LARK.strip()
        in json.loads(
            next(
                line
                for line in system["content"].splitlines()
                if line.startswith('{"name": "shell"')
            )
        )["input"]["definition"]
    )
    assistant = next(m for m in messages if m["role"] == "assistant")
    # Both calls as written text, in order (a template would turn the custom one into JSON).
    assert written("shell", "ls src") in assistant["content"]
    assert '"arguments": {"city": "Oslo"}' in assistant["content"]
    assert "tool_calls" not in assistant
    if call_format.name == "json_tools":
        assert [t["function"]["name"] for t in extra["tools"]] == ["get_weather"]
    else:
        assert extra == {}


# -- on a real server ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory, test_model_dir) -> Iterator[ServerProcess]:
    with sdk_server(tmp_path_factory.mktemp("custom-tools"), test_model_dir) as s:
        yield s


@pytest.fixture
def http(server) -> Iterator[httpx.Client]:
    with server.client() as c:
        yield c


@pytest.fixture
def sdk(server) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=server.api, api_key=TOKEN, _strict_response_validation=True
    ) as client:
        yield client


def streamed(http: httpx.Client, body: dict[str, Any]) -> list[dict[str, Any]]:
    body = {"model": MODEL, "input": ASK, "stream": True, **body}
    events = []
    with http.stream("POST", "/responses", json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data:"):
                events.append(json.loads(line[5:]))
    for event in events:
        EVENTS.validate_python(event)  # the openai SDK's own event types
    return events


def custom_events(events: list[dict[str, Any]], item_id: str) -> list[str]:
    return [
        e["type"]
        for e in events
        if e.get("item_id") == item_id or e.get("item", {}).get("id") == item_id
    ]


def test_a_forced_lark_call_streams_its_input_and_is_a_sentence(http):
    events = streamed(
        http,
        {
            "tools": [SHELL_TOOL, WEATHER_TOOL],
            "tool_choice": {"type": "custom", "name": "shell"},
            "temperature": 1.0,
            "seed": 7,
            "max_output_tokens": 200,
        },
    )
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed", final
    [call] = final["output"]
    ResponseCustomToolCall.model_validate(call)
    assert call["type"] == "custom_tool_call" and call["name"] == "shell"
    assert call["status"] == "completed" and call["call_id"].startswith("call_")
    assert SHELL_RE.fullmatch(call["input"]), call["input"]
    kinds = custom_events(events, call["id"])
    assert kinds[0] == "response.output_item.added" and kinds[-1] == "response.output_item.done"
    assert kinds[-2] == "response.custom_tool_call_input.done"
    assert set(kinds[1:-2]) == {"response.custom_tool_call_input.delta"}
    deltas = [e["delta"] for e in events if e["type"] == "response.custom_tool_call_input.delta"]
    assert "".join(deltas) == call["input"]
    done = next(e for e in events if e["type"] == "response.custom_tool_call_input.done")
    assert done["input"] == call["input"]
    # The tools are echoed as sent, the choice too.
    assert final["tools"][0] == {**SHELL_TOOL}
    assert final["tool_choice"] == {"type": "custom", "name": "shell"}
    # Retrieval gives the same output.
    stored = http.get(f"/responses/{final['id']}").json()
    assert stored["output"] == final["output"]


def test_regex_calls_in_a_batch_are_all_sentences(server):
    results: dict[int, dict[str, Any]] = {}

    def one(seed: int) -> None:
        with server.client() as c:
            r = c.post(
                "/responses",
                json={
                    "model": MODEL,
                    "input": ASK,
                    "tools": [ZIP_TOOL, SHELL_TOOL],
                    "tool_choice": "required",
                    "parallel_tool_calls": False,
                    "temperature": 1.0,
                    "seed": seed,
                    "max_output_tokens": 200,
                },
                timeout=120,
            )
            results[seed] = r.json()

    threads = [threading.Thread(target=one, args=(seed,)) for seed in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    names = set()
    for seed, response in results.items():
        assert response["status"] == "completed", (seed, response)
        [call] = response["output"]
        names.add(call["name"])
        pattern = re.compile(ZIP_REGEX) if call["name"] == "zip_code" else SHELL_RE
        assert pattern.fullmatch(call["input"]), (seed, call)


def test_the_sdk_stream_helper_gives_a_typed_custom_call(sdk):
    with sdk.responses.stream(
        model=MODEL,
        input=ASK,
        tools=[ZIP_TOOL],  # type: ignore[list-item]
        tool_choice={"type": "custom", "name": "zip_code"},
        parallel_tool_calls=False,
        temperature=0,
        max_output_tokens=100,
    ) as stream:
        seen = [event.type for event in stream]
        final = stream.get_final_response()
    assert "response.custom_tool_call_input.delta" in seen
    [call] = final.output
    assert isinstance(call, ResponseCustomToolCall)
    assert re.fullmatch(ZIP_REGEX, call.input)


def test_a_cut_off_free_text_call_closes_its_input_before_its_item(http):
    events = streamed(
        http,
        {
            "tools": [NOTE_TOOL],
            "tool_choice": "required",
            "temperature": 1.0,
            "seed": 3,
            "max_output_tokens": 24,
        },
    )
    final = events[-1]["response"]
    assert final["status"] == "incomplete"
    [call] = final["output"]
    assert call["type"] == "custom_tool_call" and call["status"] == "incomplete"
    kinds = custom_events(events, call["id"])
    assert kinds[-2:] == ["response.custom_tool_call_input.done", "response.output_item.done"]


def test_a_call_and_its_output_continue_the_conversation(http):
    first = http.post(
        "/responses",
        json={
            "model": MODEL,
            "input": ASK,
            "tools": [SHELL_TOOL],
            "tool_choice": {"type": "custom", "name": "shell"},
            "parallel_tool_calls": False,
            "temperature": 0,
            "max_output_tokens": 200,
        },
    ).json()
    [call] = first["output"]
    result = {"type": "custom_tool_call_output", "call_id": call["call_id"], "output": "a.py"}
    # Chained by id, and sent back in full as input items: both are taken.
    chained = http.post(
        "/responses",
        json={
            "model": MODEL,
            "previous_response_id": first["id"],
            "input": [result],
            "tools": [SHELL_TOOL],
            "temperature": 0,
            "max_output_tokens": 8,
        },
    )
    assert chained.status_code == 200, chained.text
    replayed = http.post(
        "/responses",
        json={
            "model": MODEL,
            "input": [*ASK, call, {**result, "output": [{"type": "input_text", "text": "a.py"}]}],
            "tools": [SHELL_TOOL],
            "temperature": 0,
            "max_output_tokens": 8,
        },
    )
    assert replayed.status_code == 200, replayed.text
    # The same prompt either way: the chained one's history is the replayed one's input.
    assert chained.json()["usage"]["input_tokens"] == replayed.json()["usage"]["input_tokens"]
    items = http.get(f"/responses/{replayed.json()['id']}/input_items?order=asc").json()["data"]
    kinds = [(i["type"], i.get("input") or i.get("output")) for i in items]
    assert kinds[1:] == [("custom_tool_call", call["input"]), ("custom_tool_call_output", "a.py")]


@pytest.mark.parametrize(
    ("change", "param", "code"),
    [
        (
            {
                "tools": [
                    {**SHELL_TOOL, "format": {**SHELL_TOOL["format"], "definition": "start: (("}}
                ]
            },  # type: ignore[dict-item]
            "tools[0].format.definition",
            "invalid_grammar",
        ),
        (
            {
                "tools": [
                    {
                        "type": "namespace",
                        "name": "box",
                        "description": "Tools in a box",
                        "tools": [
                            {**ZIP_TOOL, "format": {**ZIP_TOOL["format"], "definition": "(?=x)"}}
                        ],  # type: ignore[dict-item]
                    }
                ]
            },
            "tools[0].tools[0].format.definition",
            "invalid_grammar",
        ),
        (
            {"tools": [SHELL_TOOL], "tool_choice": {"type": "function", "name": "shell"}},
            "tool_choice.type",
            "invalid_value",
        ),
        (
            {"tools": [SHELL_TOOL, {**WEATHER_TOOL, "name": "shell"}]},
            "tools",
            "invalid_value",
        ),
        (
            {
                "tools": [
                    {
                        **SHELL_TOOL,
                        "format": {"type": "grammar", "syntax": "ebnf", "definition": "x"},
                    }
                ]
            },
            "tools[0].format.syntax",
            None,
        ),
    ],
)
def test_what_cannot_be_honoured_is_a_400_saying_where(http, change, param, code):
    r = http.post("/responses", json={"model": MODEL, "input": ASK, **change})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error


def test_chat_completions_refuse_custom_tools_by_name(http):
    r = http.post(
        "/chat/completions",
        json={"model": MODEL, "messages": ASK, "tools": [SHELL_TOOL]},
    )
    assert r.status_code == 400
    assert "custom" in r.json()["error"]["message"]
