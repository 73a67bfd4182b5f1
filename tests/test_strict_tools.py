"""Strict function tools close every object that does not say otherwise (issue 36): a strict
schema without `additionalProperties` (what LangGraph's default `bind_tools` sends) lets the
model write only the declared keys, at every depth; a non-strict one stays open, and an object
that says what its other keys may be keeps that."""

from __future__ import annotations

import json
from typing import Any

import pytest

from jupyter_lmsp.engine.grammars import (
    GENERIC,
    FunctionTool,
    ToolSpec,
    build_grammar,
    check_tools,
    closed_objects,
)

pytestmark = pytest.mark.timeout(120)

# As LangGraph's bind_tools writes a pydantic model's schema: no additionalProperties anywhere.
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "when": {
            "type": "object",
            "properties": {"day": {"type": "string"}},
            "required": ["day"],
        },
        "stops": {
            "type": "array",
            "items": {"type": "object", "properties": {"name": {"type": "string"}}},
        },
    },
    "required": ["city", "when"],
}


def test_closed_objects_closes_every_level_and_keeps_what_is_said():
    closed = closed_objects(WEATHER)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["when"]["additionalProperties"] is False
    assert closed["properties"]["stops"]["items"]["additionalProperties"] is False
    # Leaf schemas and the `properties` map itself are untouched.
    assert closed["properties"]["city"] == {"type": "string"}
    # An object that says what its other keys are keeps it (and its own schema is closed).
    mapping = {"type": "object", "additionalProperties": {"type": "object", "properties": {}}}
    assert closed_objects(mapping) == {
        "type": "object",
        "additionalProperties": {"type": "object", "properties": {}, "additionalProperties": False},
    }
    open_keys = {"type": "object", "properties": {}, "additionalProperties": True}
    assert closed_objects(open_keys) == open_keys
    patterned = {"type": "object", "patternProperties": {"^x": {"type": "string"}}}
    assert closed_objects(patterned) == patterned
    # Definitions are closed too; a combination without its own properties is left to its
    # members.
    combined = {"anyOf": [{"$ref": "#/$defs/a"}], "$defs": {"a": {"type": "object"}}}
    assert closed_objects(combined) == {
        "anyOf": [{"$ref": "#/$defs/a"}],
        "$defs": {"a": {"type": "object", "additionalProperties": False}},
    }
    # The input is not changed.
    assert "additionalProperties" not in WEATHER


def call(arguments: dict[str, Any]) -> str:
    body = json.dumps({"name": "get_weather", "arguments": arguments})
    return f"{GENERIC.start}\n{body}\n{GENERIC.end}"


def accepts(tokenizer: Any, grammar: str, text: str) -> bool:
    import llguidance
    import llguidance.hf

    ll = llguidance.hf.from_tokenizer(
        tokenizer._tokenizer, eos_token=sorted(tokenizer.eos_token_ids)
    )
    matcher = llguidance.LLMatcher(ll, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    tokens = tokenizer.encode(text, add_special_tokens=False)
    return bool(matcher.consume_tokens(tokens)) and not matcher.is_error()


@pytest.mark.parametrize("strict", [True, False])
def test_a_strict_tool_refuses_undeclared_keys(tokenizer, strict):
    spec = ToolSpec((FunctionTool("get_weather", None, WEATHER, strict),), "required")
    assert check_tools(spec) is None
    grammar = build_grammar(None, spec)
    assert grammar is not None
    declared = {"city": "Oslo", "when": {"day": "Monday"}, "stops": [{"name": "Bergen"}]}
    assert accepts(tokenizer, grammar, call(declared))
    for extra in (
        {**declared, "properties": {"city": "Oslo"}},
        {**declared, "when": {"day": "Monday", "hour": 9}},
        {**declared, "stops": [{"name": "Bergen", "x": 1}]},
    ):
        # Strict: every undeclared key is refused; not strict, the schema stays open.
        assert accepts(tokenizer, grammar, call(extra)) is not strict, extra
