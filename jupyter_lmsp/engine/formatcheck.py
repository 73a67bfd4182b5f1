"""Checking a request's tools in the model's own call format, before it is accepted (issue 37).

The server's first check (`grammars.check_tools`, in `services.generation.check`) compiles the
tools in the generic format: it does not know the model yet. A model with a format of its own
(`callformats.FAMILIES`, `harmony`) gets another grammar, in which some schemas that compile
whole do not (and harmony has no place for custom tools, refused here too): the parameter-by-parameter formats compile each parameter's schema alone, so a
`$ref` from one parameter to another (`#/properties/a`) points nowhere. Left to the worker, such
a job would fail `grammar_invalid` after it was accepted; `check_in_format` finds it at
admission (in the grammar checker's child, `grammar_check`, where the model's tokenizer and
format are known), with the place: the parameter (`tools[i].parameters.properties.k`) when one
fails alone, else the tool's parameters, else the tool list.

It compiles without a tokenizer (a marker that is a special token is a token reference,
`<[id]>`, which compiles without one); the checker then builds the whole grammar with the
model's tokenizer.
"""

from __future__ import annotations

import json

from .grammars import (
    CallFormat,
    GrammarIssue,
    ToolSpec,
    _lark,
    _validate,
    _with_options,
    build_grammar,
    check_tools,
)

# The formats `grammars.build_grammar` writes itself (checked by the server's first check).
_GENERIC_SHAPED = ("generic", "json_tools")


def _first_line(reason: str) -> str:
    # llguidance's error goes on with a listing of the whole grammar: the first line says why.
    return reason.strip().splitlines()[0] if reason.strip() else reason


def check_in_format(spec: ToolSpec, call_format: CallFormat) -> GrammarIssue | None:
    """None if `spec`'s tools compile in `call_format`, else where and why they do not (only for
    a format other than the generic shape: that one is the server's first check's)."""
    if call_format.name in _GENERIC_SHAPED or not spec.active:
        return None
    from .callformats import FAMILIES, _properties, _sub_schema

    if call_format.name == "harmony":
        callable_customs = {custom.name for custom in spec.callable_customs()}
        for i, custom in enumerate(spec.customs, start=len(spec.tools)):
            if custom.name not in callable_customs:
                continue
            return GrammarIssue(
                f"the model writes calls in gpt-oss's harmony format, which has no place for "
                f"custom tools: {custom.name!r} cannot be called (give it as a function tool)",
                ("tools", i, "type"),
            )
    callable_names = {tool.name for tool in spec.callable_tools()}
    for i, tool in enumerate(spec.tools):
        if tool.name not in callable_names:
            continue
        try:
            reason = _validate(build_grammar(None, ToolSpec((tool,), "required"), call_format))
        except (TypeError, ValueError) as exc:
            reason = str(exc)
        if not reason:
            continue
        if call_format.name in FAMILIES:
            # The formats that write arguments parameter by parameter compile each alone.
            schema, props, _ = _properties(tool)
            for key, prop in props.items():
                sub = _sub_schema(schema, prop)
                if not isinstance(sub, dict):
                    continue
                alone = json.dumps(_with_options(sub, tool.strict))
                try:
                    found = _validate(_lark("%llguidance {}\nstart: %json " + alone))
                except (TypeError, ValueError) as exc:
                    found = str(exc)
                if found:
                    return GrammarIssue(
                        f"in the model's {call_format.name} call format each parameter is "
                        f"compiled alone, and this one cannot be: {_first_line(found)}",
                        ("tools", i, "parameters", "properties", key),
                    )
        return GrammarIssue(
            f"in the model's {call_format.name} call format: {_first_line(reason)}",
            ("tools", i, "parameters"),
        )
    issue = check_tools(spec, call_format)
    if issue is not None and not issue.path:
        return GrammarIssue(f"in the model's {call_format.name} call format: {issue.reason}")
    return issue


__all__ = ["check_in_format"]
