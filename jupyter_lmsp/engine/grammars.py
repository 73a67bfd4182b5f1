"""Grammars for constrained decoding, one code path for both APIs: structured output and tools.

Pure (llguidance's compiler, no MLX, no tokenizer): the server imports it to refuse a request
whose schema cannot be compiled (`check_response_format`, `check_tools`, which give the
compiler's reason and a path into the schema for a `400`), and the worker to build a job's
grammar (`build_grammar`), which `constraints.Constraint` then enforces token by token.

What the grammars allow:

- `ResponseFormat("json_schema", schema, strict)`: exactly one JSON value valid under `schema`,
  then the end. `strict=True` compiles the schema as it is and refuses what llguidance does not
  implement (`uniqueItems`, `not`, `if`, unknown `format`s, lookaround in patterns, ...);
  `strict=False` still enforces the schema, but ignores the keywords llguidance does not
  implement instead of refusing them (llguidance's `lenient` mode). `ResponseFormat
  ("json_object")` is any JSON object. Object properties come in the order of `properties`.
- `ToolSpec`: calls in the model's call format (`CallFormat`: the generic one, or the model's own
  where it has the same shape), each `<tool_call>\\n{"name": "<name>", "arguments": <JSON>}\\n
  </tool_call>`, calls separated by a newline, nothing after the last one. `choice="auto"`:
  free text, or text followed by calls (once the text contains the start marker, a call is
  forced); `"required"`: one or more calls and nothing else; a function name: calls of that
  function only; `"none"`: no calls (no grammar, unless a response format asks for one).
  The calls may be followed by one newline, then the end.
  `parallel=False` or `max_calls=1` allows one call; `max_calls` bounds them. Arguments follow
  the function's `parameters` (strictly when the tool is `strict`, else leniently as above;
  a function without parameters takes `{}` when strict, any object otherwise). A strict
  tool's objects are closed unless they say otherwise (`closed_objects`).
- With both a response format and tools (not "none"): the JSON, or calls.
- `CustomTool`s (the Responses API's `custom` tools) take free text rather than JSON: a call of
  one is `<tool_call>\n{"name": "<name>"}\n<input>\n</tool_call>`, its input raw text. With
  `syntax="text"` the input is any text not containing the end marker; with `"lark"` or
  `"regex"` it is exactly a sentence of the tool's grammar, compiled by llguidance as a grammar
  of its own (`@custom_<i>`) that the call grammar refers to, so the user's `start`, `%ignore`
  and rule names never meet ours.

JSON whitespace is limited to at most 12 characters at each place JSON allows it (small models
otherwise fill `max_tokens` with newlines); separators and indentation stay free within that.
Numbers are bounded likewise (`json_numbers`: at most 19 digits before the point and 10 after,
unless the schema states its own bounds).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from .json_numbers import bounded_numbers
from .schema_walk import SUBSCHEMA_ONE, map_subschemas, subschemas

# Whitespace allowed at each place JSON allows it (matched at most once there).
JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{1,12}"
# OpenAI's rule for function names; it also keeps names safe to write into a grammar literal.
FUNCTION_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")

ToolChoice = str  # "auto" | "none" | "required" | the name of a function to call


@dataclass(frozen=True)
class ResponseFormat:
    """A structured-output format: "json_schema" (with `schema`) or "json_object"."""

    type: Literal["json_schema", "json_object"]
    schema: dict[str, Any] | None = None
    strict: bool = False
    name: str | None = None


@dataclass(frozen=True)
class FunctionTool:
    """A function the model may call; `parameters` is the JSON schema of its arguments."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool = True


@dataclass(frozen=True)
class CustomTool:
    """A tool whose input is text (the Responses API's `custom` tool): free text (`syntax`
    "text"), or a sentence of `definition` in llguidance's Lark syntax ("lark") or a regular
    expression ("regex", Rust `regex` syntax, matched whole)."""

    name: str
    description: str | None = None
    syntax: Literal["text", "lark", "regex"] = "text"
    definition: str | None = None


@dataclass(frozen=True)
class ToolSpec:
    """The tools of a request and how they may be called; `choice` may name a function or a
    custom tool (their names are one namespace)."""

    tools: tuple[FunctionTool, ...]
    choice: ToolChoice = "auto"
    parallel: bool = True
    max_calls: int | None = None
    customs: tuple[CustomTool, ...] = ()

    @property
    def active(self) -> bool:
        """Whether calls are possible at all (some tool, a choice other than "none")."""
        return bool(self.tools or self.customs) and self.choice != "none" and self.max_calls != 0

    def callable_tools(self) -> tuple[FunctionTool, ...]:
        if self.choice in ("auto", "required", "none"):
            return self.tools
        return tuple(tool for tool in self.tools if tool.name == self.choice)

    def callable_customs(self) -> tuple[CustomTool, ...]:
        if self.choice in ("auto", "required", "none"):
            return self.customs
        return tuple(tool for tool in self.customs if tool.name == self.choice)

    @property
    def call_limit(self) -> int | None:
        """The most calls one generation may make (None: no limit)."""
        if not self.parallel:
            return 1
        return self.max_calls


@dataclass(frozen=True)
class CallFormat:
    """How a model writes a tool call: the markers around the call's JSON.

    `name` is "generic" (the format this service teaches a model through its system prompt) or
    the mlx-lm tool parser whose format the model was trained on (same shape: "json_tools").
    `special_markers`: the markers are single special tokens of the model's tokenizer, so the
    grammar names them as tokens rather than spelling them out. Another mlx-lm format
    (`callformats.FAMILIES`: "qwen3_coder", "mistral", ...) has its own markers and grammar;
    `marker_ids` are those of its fixed strings that are single special tokens, with their ids.
    """

    name: str = "generic"
    start: str = "<tool_call>"
    end: str = "</tool_call>"
    special_markers: bool = False
    marker_ids: tuple[tuple[str, int], ...] = ()


GENERIC = CallFormat()


@dataclass(frozen=True)
class GrammarIssue:
    """Why a format or tool list cannot be compiled, and where.

    `path` leads from the object checked to the offending place: for a response format
    ("schema", <path in the schema>...), for tools ("tools", i, "parameters", <path>...),
    ("tools", i, "name") or ("choice",).
    """

    reason: str
    path: tuple[str | int, ...] = ()

    @property
    def pointer(self) -> str:
        """`path` as a JSON pointer (RFC 6901)."""
        return "".join("/" + str(part).replace("~", "~0").replace("/", "~1") for part in self.path)


class GrammarError(ValueError):
    """A grammar could not be built; `issue` says why and where."""

    def __init__(self, issue: GrammarIssue) -> None:
        where = f" at {issue.pointer}" if issue.path else ""
        super().__init__(f"{issue.reason}{where}")
        self.issue = issue


# --- validation -----------------------------------------------------------------------------


def check_response_format(fmt: ResponseFormat) -> GrammarIssue | None:
    """None if `fmt` compiles, else the compiler's reason and the path to the culprit."""
    if fmt.type == "json_object":
        return None
    if fmt.type != "json_schema":
        return GrammarIssue(f"unknown response format type {fmt.type!r}", ("type",))
    if not isinstance(fmt.schema, dict):
        return GrammarIssue("the schema must be a JSON object", ("schema",))
    found = check_schema(fmt.schema, strict=fmt.strict)
    if found is None:
        return None
    return GrammarIssue(found.reason, ("schema", *found.path))


def check_tools(spec: ToolSpec, call_format: CallFormat = GENERIC) -> GrammarIssue | None:
    """None if every tool's parameters compile and the choice names a tool, else the first
    issue found; the whole grammar is compiled in `call_format` (the server, which does not
    know the model's, checks the generic one; the worker builds the model's and fails a job
    whose grammar does not compile with `grammar_invalid`)."""
    names: set[str] = set()
    for i, tool in enumerate(spec.tools):
        if not FUNCTION_NAME.match(tool.name):
            return GrammarIssue(
                "a function name must be 1 to 64 letters, digits, underscores or dashes",
                ("tools", i, "name"),
            )
        if tool.name in names:
            return GrammarIssue(f"duplicate function name {tool.name!r}", ("tools", i, "name"))
        names.add(tool.name)
        if tool.parameters is not None and not isinstance(tool.parameters, dict):
            return GrammarIssue(
                "parameters must be a JSON schema object", ("tools", i, "parameters")
            )
        found = check_schema(_arguments_schema(tool), strict=tool.strict)
        if found is not None:
            return GrammarIssue(found.reason, ("tools", i, "parameters", *found.path))
    for i, custom in enumerate(spec.customs, start=len(spec.tools)):
        if not FUNCTION_NAME.match(custom.name):
            return GrammarIssue(
                "a tool name must be 1 to 64 letters, digits, underscores or dashes",
                ("tools", i, "name"),
            )
        if custom.name in names:
            return GrammarIssue(f"duplicate tool name {custom.name!r}", ("tools", i, "name"))
        names.add(custom.name)
        reason = check_custom(custom)
        if reason:
            return GrammarIssue(reason, ("tools", i, "format", "definition"))
    if spec.choice not in ("auto", "none", "required") and spec.choice not in names:
        return GrammarIssue(f"tool_choice names no tool: {spec.choice!r}", ("choice",))
    if spec.choice == "required" and not (spec.tools or spec.customs):
        return GrammarIssue('tool_choice "required" needs at least one tool', ("choice",))
    if spec.max_calls is not None and spec.max_calls < 0:
        return GrammarIssue("max_calls must be >= 0", ("max_calls",))
    if spec.active:
        # The whole grammar too (it should compile whenever its parts do).
        try:
            reason = _validate(build_grammar(None, spec, call_format))
        except (TypeError, ValueError) as exc:
            reason = str(exc)
        if reason:
            return GrammarIssue(reason, ())
    return None


def check_custom(tool: CustomTool) -> str:
    """Why `tool`'s grammar cannot be compiled by llguidance ("" if it can, or has none)."""
    if tool.syntax == "text":
        return ""
    if not tool.definition or not tool.definition.strip():
        return "a grammar definition must not be empty"
    try:
        grammar = _custom_grammar(tool)
    except (TypeError, ValueError) as exc:
        return str(exc)
    return _validate(json.dumps({"grammars": [{"lark_grammar": grammar}]}))


def check_schema(schema: dict[str, Any], *, strict: bool) -> GrammarIssue | None:
    """None if llguidance compiles `schema`, else its reason and the path (in the schema) of
    the deepest sub-schema that fails by itself with the same reason, plus the keyword."""
    reason = _schema_error(schema, schema, strict)
    if not reason:
        return None
    return GrammarIssue(reason, _locate(schema, schema, (), reason, strict))


def _schema_error(root: dict[str, Any], schema: Any, strict: bool) -> str:
    if not isinstance(schema, dict):
        return "" if isinstance(schema, bool) else "a schema must be an object or a boolean"
    if schema is not root:
        # A sub-schema compiled alone still sees the root's definitions.
        schema = {**schema}
        for defs in ("$defs", "definitions"):
            if isinstance(root.get(defs), dict) and defs not in schema:
                schema[defs] = root[defs]
    try:
        grammar = _json_grammar(schema, strict)
    except (TypeError, ValueError) as exc:
        return str(exc)
    return _validate(grammar)


def _locate(
    root: dict[str, Any],
    node: dict[str, Any],
    path: tuple[str | int, ...],
    reason: str,
    strict: bool,
) -> tuple[str | int, ...]:
    for step, child in subschemas(node):
        if isinstance(child, dict) and _schema_error(root, child, strict) == reason:
            return _locate(root, child, (*path, *step), reason, strict)
    keyword = _keyword_of(node, reason)
    return (*path, keyword) if keyword else path


def _keyword_of(node: dict[str, Any], reason: str) -> str | None:
    """The keyword of `node` that `reason` (an llguidance error) is about, if it says."""
    unimplemented = re.match(r'Unimplemented keys: \["([^"]+)"', reason)
    if unimplemented and unimplemented.group(1) in node:
        return unimplemented.group(1)
    if reason.startswith("Unknown format") and "format" in node:
        return "format"
    if "regex parse error" in reason and "pattern" in node:
        return "pattern"
    if "Properties" in reason:
        for keyword in ("minProperties", "maxProperties"):
            if keyword in node:
                return keyword
    if ("Pointer" in reason or "Resource" in reason) and "$ref" in node:
        return "$ref"
    return None


# --- building -------------------------------------------------------------------------------


def build_grammar(
    response_format: ResponseFormat | None,
    tools: ToolSpec | None,
    call_format: CallFormat = GENERIC,
) -> str | None:
    """The llguidance grammar for a job, or None when its output is unconstrained."""
    if call_format.name == "harmony":
        # gpt-oss: every answer is in a channel, calls or not (`harmony`).
        from .harmony import harmony_grammar

        return harmony_grammar(response_format, tools, call_format)
    calls = tools is not None and tools.active
    if not calls:
        if response_format is None:
            return None
        return _json_grammar(_format_schema(response_format), response_format.strict)
    assert tools is not None
    if call_format.name not in ("generic", "json_tools"):
        from .callformats import family_grammar

        return family_grammar(response_format, tools, call_format)
    lines = ["%llguidance {}"]
    start, end = _marker(call_format.start, call_format), _marker(call_format.end, call_format)
    functions = tools.callable_tools()
    customs = tools.callable_customs()
    kinds = []
    if functions:
        kinds.append('fn "\\n" ' + end)
        lines.append("fn: " + " | ".join(f"fn_{i}" for i in range(len(functions))))
    for i, tool in enumerate(functions):
        head = json.dumps('{"name": ' + json.dumps(tool.name) + ', "arguments": ')
        schema = _with_options(_arguments_schema(tool), tool.strict)
        lines.append(f'fn_{i}: {head} %json {json.dumps(schema)} "}}"')
    subgrammars: list[dict[str, str]] = []
    for i, custom in enumerate(customs):
        head = json.dumps('{"name": ' + json.dumps(custom.name) + "}\n")
        kinds.append(f"custom_{i}")
        if custom.syntax == "text":
            if call_format.special_markers:
                # A special token never occurs in text: the text simply ends at the marker.
                lines.append(f"custom_{i}: {head} TEXT {end}")
            else:
                # The input ends at the first end marker (which it therefore cannot contain).
                lines.append(f"custom_{i}[lazy]: {head} TEXT " + json.dumps("\n" + call_format.end))
        else:
            name = f"custom_{i}"
            subgrammars.append({"name": name, "lark_grammar": _custom_grammar(custom)})
            lines.append(f'custom_{i}: {head} @{name} "\\n" {end}')
    # One newline lexeme before every kind of call: a longer literal that began with it would
    # be preferred by the lexer over the bare newline a function call needs.
    lines.append('body: "\\n" (' + " | ".join(kinds) + ")")
    limit = tools.call_limit
    repeat = f' ("\\n" {start} body)'
    more = "" if limit == 1 else repeat + "*" if limit is None else repeat + f"{{0,{limit - 1}}}"
    # A newline may end the calls (a model often writes one before it stops).
    more += ' "\\n"?'
    needs_text = tools.choice == "auto" or any(c.syntax == "text" for c in customs)
    if needs_text:
        lines.append("TEXT: /(?s:.*)/")
    if response_format is not None:
        schema = _with_options(_format_schema(response_format), response_format.strict)
        lines.append(f"answer: %json {json.dumps(schema)}")
        lines.append(f"start: answer | {start} body{more}")
    elif tools.choice == "auto":
        if call_format.special_markers:
            # A special token never occurs inside text: no lazy lexeme needed.
            lines.append(f"start: TEXT | TEXT {start} body{more}")
        else:
            # Text ends at the first start marker, which then must begin a call.
            lines.append(f"call_head[lazy]: TEXT {start}")
            lines.append(f"start: TEXT | call_head body{more}")
    else:
        lines.append(f"start: {start} body{more}")
    main = _lark("\n".join(lines))
    if not subgrammars:
        return main
    return json.dumps({"grammars": [{"lark_grammar": main}, *subgrammars]})


def _custom_grammar(tool: CustomTool) -> str:
    """A custom tool's grammar as Lark text of its own (a regex becomes `start: /.../`, as
    llguidance writes it)."""
    import llguidance

    definition = tool.definition or ""
    if tool.syntax == "regex":
        whole = json.loads(llguidance.LLMatcher.grammar_from_regex(definition))
        return str(whole["grammars"][0]["lark_grammar"])
    return definition


def _marker(text: str, call_format: CallFormat) -> str:
    return text if call_format.special_markers else json.dumps(text)


def _format_schema(fmt: ResponseFormat) -> dict[str, Any]:
    if fmt.type == "json_object":
        return {"type": "object"}
    if not isinstance(fmt.schema, dict):
        raise GrammarError(GrammarIssue("the schema must be a JSON object", ("schema",)))
    return fmt.schema


def _arguments_schema(tool: FunctionTool) -> dict[str, Any]:
    if tool.parameters is not None:
        return closed_objects(tool.parameters) if tool.strict else tool.parameters
    if tool.strict:
        return {"type": "object", "properties": {}, "additionalProperties": False}
    return {"type": "object"}


# The walk of `closed_objects`: every sub-schema but the ones that say what an object's other
# keys may be (`additionalProperties` is closed on its own below).
_ONE_SCHEMA = tuple(
    k for k in SUBSCHEMA_ONE if k not in ("additionalProperties", "unevaluatedProperties")
)
# Keywords that already say what an object's other keys may be.
_OPEN_KEYWORDS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def closed_objects(schema: Any) -> Any:
    """`schema` with every object that does not say what its other keys may be closed
    (`additionalProperties: false`), at every depth: OpenAI's strict mode means closed objects,
    and clients (LangGraph's default `bind_tools`) send strict schemas that leave it out.
    An object schema is one of type `object` or with `properties`; one that combines
    sub-schemas (`anyOf`, `allOf`, `$ref`, ...) without its own properties is left open, so the
    combination's members decide."""
    if not isinstance(schema, dict):
        return schema
    out = map_subschemas(schema, closed_objects, _ONE_SCHEMA)
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = closed_objects(out["additionalProperties"])
    kind = out.get("type")
    is_object = kind == "object" or (isinstance(kind, list) and "object" in kind)
    says_keys = any(key in out for key in _OPEN_KEYWORDS)
    if ("properties" in out or (is_object and not _combines(out))) and not says_keys:
        out["additionalProperties"] = False
    return out


def _combines(schema: dict[str, Any]) -> bool:
    return any(key in schema for key in ("anyOf", "allOf", "oneOf", "$ref"))


def _with_options(schema: dict[str, Any], strict: bool) -> dict[str, Any]:
    options = dict(schema.get("x-guidance") or {})
    options.setdefault("whitespace_pattern", JSON_WHITESPACE)
    options["lenient"] = not strict
    # Numbers bounded as whitespace is (`json_numbers`): a model cannot write digits forever.
    return {**bounded_numbers(schema), "x-guidance": options}


def _json_grammar(schema: dict[str, Any], strict: bool) -> str:
    import llguidance

    return llguidance.LLMatcher.grammar_from_json_schema(
        bounded_numbers(schema),
        defaults={"whitespace_pattern": JSON_WHITESPACE},
        overrides={"lenient": not strict},
    )


def _lark(text: str) -> str:
    import llguidance

    return llguidance.LLMatcher.grammar_from_lark(text)


def _validate(grammar: str | None) -> str:
    if grammar is None:
        return ""
    import llguidance

    return llguidance.LLMatcher.validate_grammar(grammar)
