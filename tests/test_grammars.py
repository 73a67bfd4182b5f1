"""Grammars for structured output and tool calls (`engine.grammars`), checked with llguidance's
real matcher on the test model's tokenizer: which texts each grammar accepts and refuses, and
the validation entry point's reasons and paths for schemas it cannot compile."""

from __future__ import annotations

from typing import Any

import pytest

from jupyter_lmsp.engine.grammars import (
    GENERIC,
    CallFormat,
    FunctionTool,
    GrammarIssue,
    ResponseFormat,
    ToolSpec,
    build_grammar,
    check_response_format,
    check_schema,
    check_tools,
    closed_objects,
)

WEATHER = FunctionTool(
    "get_weather",
    "The weather in a city.",
    {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
)
CLOCK = FunctionTool("get_time", None, None)
LOOSE = FunctionTool(
    "search", None, {"type": "object", "properties": {"q": {"type": "string"}}}, strict=False
)


def call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


PARIS = call("get_weather", '{"city": "Paris"}')
ROME = call("get_weather", '{"city": "Rome"}')
TIME = call("get_time", "{}")


@pytest.fixture(scope="module")
def ll(tokenizer):  # type: ignore[no-untyped-def]
    import llguidance.hf

    return llguidance.hf.from_tokenizer(
        tokenizer._tokenizer, eos_token=sorted(tokenizer.eos_token_ids)
    )


def accepts(ll: Any, tokenizer: Any, grammar: str, text: str) -> bool:
    """Whether `text` then EOS is a complete output under `grammar`."""
    import llguidance

    matcher = llguidance.LLMatcher(ll, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    ids = tokenizer.encode(text, add_special_tokens=False)
    if matcher.try_consume_tokens(ids) != len(ids):
        return False
    return matcher.consume_token(ll.eos_token) and matcher.is_stopped()


def test_json_schema_format_accepts_exactly_valid_json(ll, tokenizer) -> None:
    fmt = ResponseFormat(
        "json_schema",
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "y"]}},
            "required": ["a"],
            "additionalProperties": False,
        },
        strict=True,
    )
    grammar = build_grammar(fmt, None)
    assert grammar is not None
    assert accepts(ll, tokenizer, grammar, '{"a": 1}')
    assert accepts(ll, tokenizer, grammar, '{\n  "a": -7,\n  "b": "y"\n}')
    for bad in ['{"a": "1"}', '{"b": "x"}', '{"a": 1, "c": 2}', '{"a": 1} trailing', "[1]", ""]:
        assert not accepts(ll, tokenizer, grammar, bad), bad
    # Whitespace is bounded (12 characters at one place), not forbidden.
    assert accepts(ll, tokenizer, grammar, '{"a":' + " " * 12 + "1}")
    assert not accepts(ll, tokenizer, grammar, '{"a":' + " " * 13 + "1}")


def test_json_object_format_takes_any_object(ll, tokenizer) -> None:
    grammar = build_grammar(ResponseFormat("json_object"), None)
    assert grammar is not None
    assert accepts(ll, tokenizer, grammar, '{"anything": [1, {"b": null}]}')
    assert not accepts(ll, tokenizer, grammar, '"a string"')
    assert not accepts(ll, tokenizer, grammar, "no json")


def test_no_format_and_no_active_tools_is_unconstrained() -> None:
    assert build_grammar(None, None) is None
    assert build_grammar(None, ToolSpec((WEATHER,), "none")) is None
    assert build_grammar(None, ToolSpec((), "auto")) is None
    assert build_grammar(None, ToolSpec((WEATHER,), "auto", max_calls=0)) is None


def test_tool_choice_auto_allows_text_or_calls(ll, tokenizer) -> None:
    grammar = build_grammar(None, ToolSpec((WEATHER, CLOCK), "auto"))
    assert grammar is not None
    assert accepts(ll, tokenizer, grammar, "Just an answer, no call.")
    assert accepts(ll, tokenizer, grammar, "Let me look. " + PARIS)
    assert accepts(ll, tokenizer, grammar, PARIS + "\n" + TIME)
    # Once the text has the start marker, a valid call must follow.
    assert not accepts(ll, tokenizer, grammar, "I will <tool_call> chat instead")
    assert not accepts(ll, tokenizer, grammar, call("get_wether", '{"city": "Paris"}'))
    assert not accepts(ll, tokenizer, grammar, call("get_weather", '{"town": "Paris"}'))
    # A strict function without parameters takes exactly {}.
    assert not accepts(ll, tokenizer, grammar, call("get_time", '{"tz": "UTC"}'))
    # Nothing after the calls.
    assert not accepts(ll, tokenizer, grammar, PARIS + " and some text")


def test_required_named_and_parallel_tool_choices(ll, tokenizer) -> None:
    required = build_grammar(None, ToolSpec((WEATHER, CLOCK), "required"))
    assert required is not None
    assert accepts(ll, tokenizer, required, PARIS)
    assert accepts(ll, tokenizer, required, PARIS + "\n" + TIME + "\n" + ROME)
    assert not accepts(ll, tokenizer, required, "No call.")
    assert not accepts(ll, tokenizer, required, "Text first. " + PARIS)

    single = build_grammar(None, ToolSpec((WEATHER, CLOCK), "required", parallel=False))
    assert single is not None
    assert accepts(ll, tokenizer, single, TIME)
    assert not accepts(ll, tokenizer, single, PARIS + "\n" + TIME)

    two = build_grammar(None, ToolSpec((WEATHER, CLOCK), "required", max_calls=2))
    assert two is not None
    assert accepts(ll, tokenizer, two, PARIS + "\n" + ROME)
    assert not accepts(ll, tokenizer, two, PARIS + "\n" + ROME + "\n" + TIME)

    named = build_grammar(None, ToolSpec((WEATHER, CLOCK), "get_time"))
    assert named is not None
    assert accepts(ll, tokenizer, named, TIME)
    assert not accepts(ll, tokenizer, named, PARIS)


def test_non_strict_tools_enforce_their_schema_leniently(ll, tokenizer) -> None:
    loose = FunctionTool(
        "pick",
        None,
        {
            "type": "object",
            "properties": {"ids": {"type": "array", "items": {"type": "integer"}}},
            # Not implemented by llguidance: refused when strict, ignored when not.
            "dependentRequired": {"ids": ["other"]},
        },
        strict=False,
    )
    grammar = build_grammar(None, ToolSpec((loose, LOOSE), "required"))
    assert grammar is not None
    assert accepts(ll, tokenizer, grammar, call("pick", '{"ids": [1, 2]}'))
    assert not accepts(ll, tokenizer, grammar, call("pick", '{"ids": ["a"]}'))
    assert accepts(ll, tokenizer, grammar, call("search", '{"q": "x", "extra": true}'))
    strict = FunctionTool(loose.name, None, loose.parameters, strict=True)
    assert check_tools(ToolSpec((strict,))) == GrammarIssue(
        'Unimplemented keys: ["dependentRequired"]',
        ("tools", 0, "parameters", "dependentRequired"),
    )


def test_response_format_with_tools_is_the_json_or_calls(ll, tokenizer) -> None:
    fmt = ResponseFormat(
        "json_schema",
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        strict=True,
    )
    grammar = build_grammar(fmt, ToolSpec((WEATHER,), "auto"))
    assert grammar is not None
    assert accepts(ll, tokenizer, grammar, '{"a": 3}')
    assert accepts(ll, tokenizer, grammar, PARIS)
    assert not accepts(ll, tokenizer, grammar, "free text")


def test_special_token_markers_are_matched_as_tokens(ll, tokenizer) -> None:
    """A model whose call markers are special tokens must emit those tokens, not spell them
    out (the test model's `<|system|>`/`<|user|>` stand in for `<tool_call>`/`</tool_call>`)."""
    import llguidance

    markers = CallFormat("json_tools", "<|system|>", "<|user|>", special_markers=True)
    grammar = build_grammar(None, ToolSpec((WEATHER,), "auto"), markers)
    assert grammar is not None
    start, end = (tokenizer.convert_tokens_to_ids(t) for t in ("<|system|>", "<|user|>"))
    body = tokenizer.encode('\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n')
    text = tokenizer.encode("Sure. ", add_special_tokens=False)
    for tokens, ok in [
        ([*text, start, *body, end], True),
        (text, True),
        (tokenizer.encode("Sure. <|system|>" + '\n{"name"', add_special_tokens=False), True),
    ]:
        matcher = llguidance.LLMatcher(ll, grammar, log_level=0)
        assert (matcher.try_consume_tokens(tokens) == len(tokens)) is ok
    # Spelled out, the marker is just text: no call is forced after it.
    spelled = [
        *tokenizer.encode("<|sys", add_special_tokens=False),
        *tokenizer.encode("tem|> not a call", add_special_tokens=False),
    ]
    assert start not in spelled
    matcher = llguidance.LLMatcher(ll, grammar, log_level=0)
    assert matcher.try_consume_tokens(spelled) == len(spelled)
    # With the special token, the call is forced.
    matcher = llguidance.LLMatcher(ll, grammar, log_level=0)
    assert matcher.consume_tokens([start])
    wrong = tokenizer.encode(" not a call", add_special_tokens=False)
    assert matcher.try_consume_tokens(wrong) < len(wrong)
    assert '"<|system|>"' not in grammar
    plain = build_grammar(None, ToolSpec((WEATHER,), "auto"), GENERIC)
    assert plain is not None and '"<tool_call>"' in plain


# --- validation -----------------------------------------------------------------------------

NESTED_BAD_FORMAT = {
    "type": "object",
    "properties": {
        "a": {
            "type": "array",
            "items": {"type": "object", "properties": {"b": {"type": "string", "format": "iban"}}},
        }
    },
}


@pytest.mark.parametrize(
    "schema,reason,path",
    [
        (
            NESTED_BAD_FORMAT,
            "Unknown format: iban",
            ("properties", "a", "items", "properties", "b", "format"),
        ),
        (
            {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
            'Unimplemented keys: ["uniqueItems"]',
            ("uniqueItems",),
        ),
        (
            {"anyOf": [{"type": "string"}, {"type": "object", "properties": {"x": {"not": {}}}}]},
            'Unimplemented keys: ["not"]',
            ("anyOf", 1, "properties", "x", "not"),
        ),
        (
            {"type": "object", "properties": {"s": {"type": "string", "pattern": "^(?=a)b"}}},
            "look-around",
            ("properties", "s", "pattern"),
        ),
        (
            {
                "$defs": {"t": {"if": {"type": "string"}, "then": {"minLength": 1}}},
                "$ref": "#/$defs/t",
            },
            'Unimplemented keys: ["if"',
            ("$defs", "t", "if"),
        ),
        (
            {"type": "object", "properties": {"r": {"$ref": "#/$defs/missing"}}},
            "does not exist",
            ("properties", "r", "$ref"),
        ),
        (
            {"$ref": "https://example.com/remote.json"},
            "retrieving it failed",
            ("$ref",),
        ),
        (
            {"type": "object", "properties": {"a": {"type": "string"}}, "minProperties": 1},
            "min/maxProperties",
            ("minProperties",),
        ),
        (
            {"type": "array", "contains": {"type": "string"}},
            'Unimplemented keys: ["contains"]',
            ("contains",),
        ),
    ],
)
def test_unsupported_schemas_get_a_reason_and_a_path(
    schema: dict[str, Any], reason: str, path: tuple[str | int, ...]
) -> None:
    issue = check_response_format(ResponseFormat("json_schema", schema, strict=True))
    assert issue is not None
    assert reason in issue.reason
    assert issue.path == ("schema", *path)
    assert issue.pointer == "/schema/" + "/".join(str(p) for p in path)
    # The same schema in a tool's parameters: the path leads into that tool. A strict tool
    # closes the objects that leave `additionalProperties` out (`closed_objects`), and on a
    # closed object llguidance implements min/maxProperties: that case is kept open here, so
    # the tool gets the same schema the response format got.
    closes = "Properties" in reason and closed_objects(schema) != schema
    tool_schema = {**schema, "additionalProperties": True} if closes else schema
    if closes:
        assert check_tools(ToolSpec((WEATHER, FunctionTool("f", None, schema)))) is None
    found = check_tools(ToolSpec((WEATHER, FunctionTool("f", None, tool_schema))))
    assert found is not None and found.path == ("tools", 1, "parameters", *path)


def test_lenient_formats_ignore_what_llguidance_does_not_implement() -> None:
    assert check_response_format(ResponseFormat("json_schema", NESTED_BAD_FORMAT)) is None
    # ... but what it cannot compile at all is still refused.
    broken = {"type": "string", "pattern": "(unclosed"}
    issue = check_response_format(ResponseFormat("json_schema", broken, strict=False))
    assert issue is not None and issue.path == ("schema", "pattern")


def test_pointer_escapes_and_bad_shapes() -> None:
    assert GrammarIssue("r", ("properties", "a/b", "c~d")).pointer == "/properties/a~1b/c~0d"
    assert check_schema({"type": "object"}, strict=True) is None
    assert check_response_format(ResponseFormat("json_object")) is None
    issue = check_response_format(ResponseFormat("json_schema", None))
    assert issue is not None and issue.path == ("schema",)


def test_tool_lists_are_checked() -> None:
    assert check_tools(ToolSpec((WEATHER, CLOCK, LOOSE), "get_time")) is None
    bad_name = check_tools(ToolSpec((FunctionTool("no spaces allowed"),)))
    assert bad_name is not None and bad_name.path == ("tools", 0, "name")
    twice = check_tools(ToolSpec((WEATHER, WEATHER)))
    assert twice is not None and twice.path == ("tools", 1, "name")
    unknown = check_tools(ToolSpec((WEATHER,), "get_time"))
    assert unknown is not None and unknown.path == ("choice",)
    required_nothing = check_tools(ToolSpec((), "required"))
    assert required_nothing is not None and required_nothing.path == ("choice",)


def test_the_pure_modules_import_without_mlx() -> None:
    """The server process validates requests and parses tool calls without loading MLX."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import jupyter_lmsp.engine.grammars, jupyter_lmsp.engine.toolcalls\n"
        "import jupyter_lmsp.engine.stops, jupyter_lmsp.engine.messages\n"
        "import jupyter_lmsp.engine.client\n"
        "from jupyter_lmsp.engine.grammars import ResponseFormat, check_response_format\n"
        "assert check_response_format(ResponseFormat('json_object')) is None\n"
        "assert not [m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm')], 'mlx'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
