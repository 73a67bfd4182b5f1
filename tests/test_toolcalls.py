"""Tool calls in text (`engine.toolcalls`): rendering tools and past calls into the prompt, and
the streaming parser that splits generated text into content and calls."""

from __future__ import annotations

import json
import random

import pytest

from jupyter_lmsp.engine.grammars import CallFormat, FunctionTool, ToolSpec
from jupyter_lmsp.engine.toolcalls import (
    ArgumentsDelta,
    CallDone,
    CallStart,
    ContentDelta,
    ParserEvent,
    ToolCallError,
    ToolCallParser,
    call_format_for,
    render,
)

WEATHER = FunctionTool(
    "get_weather",
    "The weather in a city.",
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)
TOOLS = ToolSpec((WEATHER,), "auto")

TEXT = (
    "Let me check that. <tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris \\"<tool_call>\\" {x}", "n": [1, {"a": 2}]}}'
    "\n</tool_call>\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {}}'
    "\n</tool_call>"
)
ARGS_1 = '{"city": "Paris \\"<tool_call>\\" {x}", "n": [1, {"a": 2}]}'


def parse(pieces: list[str], **kw: object) -> list[ParserEvent]:
    parser = ToolCallParser(**kw)  # type: ignore[arg-type]
    events: list[ParserEvent] = []
    for piece in pieces:
        events += parser.feed(piece)
    return events + parser.finish()


def summary(events: list[ParserEvent]) -> tuple[str, list[tuple[str, str]], dict[int, str]]:
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    calls = [(e.name, e.arguments) for e in events if isinstance(e, CallDone)]
    deltas: dict[int, str] = {}
    for e in events:
        if isinstance(e, ArgumentsDelta):
            deltas[e.index] = deltas.get(e.index, "") + e.delta
    return content, calls, deltas


def test_whole_text_parses_into_content_and_calls() -> None:
    events = parse([TEXT])
    content, calls, deltas = summary(events)
    assert content == "Let me check that. "
    assert calls == [("get_weather", ARGS_1), ("get_weather", "{}")]
    assert deltas == {0: ARGS_1, 1: "{}"}
    assert json.loads(calls[0][1])["city"] == 'Paris "<tool_call>" {x}'
    kinds = [type(e).__name__ for e in events]
    assert kinds[0] == "ContentDelta" and kinds[1] == "CallStart" and kinds[-1] == "CallDone"


@pytest.mark.parametrize("seed", range(5))
def test_any_chunking_gives_the_same_result_and_streams_arguments(seed: int) -> None:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(TEXT)), 25))
    pieces = [TEXT[a:b] for a, b in zip([0, *cuts], [*cuts, len(TEXT)], strict=True)]
    events = parse(pieces)
    assert summary(events) == summary(parse([TEXT]))
    # Character by character: the arguments arrive in many deltas, each call starting (with
    # its name) before any of its arguments.
    events = parse(list(TEXT))
    assert summary(events) == summary(parse([TEXT]))
    first = [e for e in events if getattr(e, "index", None) == 0]
    assert isinstance(first[0], CallStart) and first[0].name == "get_weather"
    assert sum(isinstance(e, ArgumentsDelta) for e in first) > 10
    # Content never shows a part of the marker, even while it could still be one.
    assert all("<" not in e.text for e in events if isinstance(e, ContentDelta))


def test_plain_text_and_a_partial_marker_at_the_end_are_content() -> None:
    assert summary(parse(["No tools needed", "."])) == ("No tools needed.", [], {})
    parser = ToolCallParser()
    assert parser.feed("Tags look like <tool_c") == [ContentDelta("Tags look like ")]
    assert parser.finish() == [ContentDelta("<tool_c")]


def test_arguments_before_name_are_parsed_in_one_piece() -> None:
    text = '<tool_call>\n{"arguments": {"city": "Oslo"}, "name": "get_weather"}\n</tool_call>'
    content, calls, deltas = summary(parse(list(text)))
    assert content == "" and calls == [("get_weather", '{"city": "Oslo"}')]
    assert deltas == {0: '{"city": "Oslo"}'}


@pytest.mark.parametrize(
    "text,message",
    [
        ("<tool_call>\nnot json\n</tool_call>", "not valid JSON"),
        ('<tool_call>\n{"name": "f"}\n</tool_call>', "must be"),
        ('<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>', "must be"),
        ('<tool_call>\n{"name": "get_weather", "arguments": {"a": 1}', "ended inside"),
        ('<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>', "unknown function"),
        ('<tool_call>\n{"arguments": {}, "name": "nope"}\n</tool_call>', "unknown function"),
    ],
)
def test_unparseable_calls_fail_loudly(text: str, message: str) -> None:
    with pytest.raises(ToolCallError, match=message):
        parse([text], names={"get_weather", "f"})


def test_other_markers() -> None:
    fmt = CallFormat("json_tools", "[CALL]", "[/CALL]")
    text = 'Hi [CALL]{"name": "x", "arguments": {"k": 1}}[/CALL]'
    assert summary(parse(list(text), call_format=fmt))[:2] == ("Hi ", [("x", '{"k": 1}')])


# --- rendering ------------------------------------------------------------------------------

HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
            {"id": "c2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "c2", "content": "rain"},
]


def test_generic_rendering_puts_tools_in_the_system_prompt_and_calls_in_text() -> None:
    messages, extra = render(HISTORY, TOOLS)
    assert extra == {}
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[0]["content"].startswith("Be brief.\n\n# Tools")
    assert '"name": "get_weather"' in messages[0]["content"]
    assert messages[2]["content"] == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    )
    # The call text is what the model writes, so the parser reads it back.
    assert summary(parse([messages[2]["content"]]))[1] == [
        ("get_weather", '{"city": "Paris"}'),
        ("get_weather", '{"city": "Rome"}'),
    ]
    assert messages[3]["content"] == (
        "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response>"
    )
    # No tools shown when none may be called; past calls still rendered; no system prompt made.
    messages, _ = render(HISTORY[1:], ToolSpec((WEATHER,), "none"))
    assert messages[0]["role"] == "user" and "# Tools" not in str(messages)
    messages, _ = render(HISTORY[1:2], TOOLS)
    assert messages[0]["role"] == "system" and messages[0]["content"].startswith("# Tools")


def test_native_rendering_hands_tools_to_the_template() -> None:
    fmt = call_format_for("json_tools")
    assert fmt.name == "json_tools"
    # Another format mlx-lm knows is its own (tests/test_call_formats.py); an unknown one is
    # generic.
    assert call_format_for("pythonic").name == "pythonic"
    assert call_format_for("no_such_parser").name == "generic"
    assert call_format_for(None).name == "generic"
    messages, extra = render(HISTORY, TOOLS, fmt)
    assert extra["tools"][0]["function"]["name"] == "get_weather"
    assert messages[2]["tool_calls"][0]["function"] == {
        "name": "get_weather",
        "arguments": {"city": "Paris"},
    }
    assert messages[3] == {"role": "tool", "content": "sunny", "tool_call_id": "c1"}
