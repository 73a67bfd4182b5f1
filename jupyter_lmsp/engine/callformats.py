"""The tool-call formats of mlx-lm's parsers other than the generic shape (issue 37).

`toolcalls` keeps the generic format (`<tool_call>\\n{"name": …, "arguments": …}\\n
</tool_call>`, taught through the system prompt) and `json_tools` (the same text, rendered by
the model's own template). This module adds the formats of the other parsers mlx-lm ships
(`mlx_lm.tool_parsers`), one `Family` each:

| family | a call as the model writes it |
| --- | --- |
| `qwen3_coder` | `<tool_call>\\n<function=f>\\n<parameter=k>\\nv\\n</parameter>\\n</function>\\n</tool_call>` |
| `glm47`, `laguna` | `<tool_call>f<arg_key>k</arg_key><arg_value>v</arg_value></tool_call>` |
| `longcat` | `glm47`'s, with `longcat_` tags |
| `minimax_m2` | `<minimax:tool_call>\\n<invoke name="f">\\n<parameter name="k">v</parameter>\\n</invoke>\\n</minimax:tool_call>` |
| `mistral` | `[TOOL_CALLS]f[ARGS]{…}` (no end marker) |
| `mistral_json` | `[TOOL_CALLS] [{"name": "f", "arguments": {…}}]` (mlx-lm's `mistral` parser; older templates) |
| `kimi_k2` | `<\\|tool_calls_section_begin\\|><\\|tool_call_begin\\|>functions.f:0<\\|tool_call_argument_begin\\|>{…}<\\|tool_call_end\\|><\\|tool_calls_section_end\\|>` |
| `kimi_k3` | `<\\|open\\|>tools<\\|sep\\|><\\|open\\|>call tool="f" index="0"<\\|sep\\|><\\|open\\|>argument key="k" type="string"<\\|sep\\|>v<\\|close\\|>argument<\\|sep\\|><\\|close\\|>call<\\|sep\\|><\\|close\\|>tools<\\|sep\\|>` |
| `pythonic` | `<\\|tool_call_start\\|>[f(k="v", n=1)]<\\|tool_call_end\\|>` |
| `minicpm5` | `<function name="f"><param name="k">v</param></function>` |
| `muse_spark` | `<atem:function_calls><atem:invoke name="f"><atem:parameter name="k">"v"</atem:parameter></atem:invoke></atem:function_calls>` |
| `gemma4` | `<\\|tool_call>call:f{k:<\\|"\\|>v<\\|"\\|>,n:1}<tool_call\\|>` |
| `function_gemma` | `<start_function_call>call:f{k:<escape>v<escape>,n:1}<end_function_call>` |

Rendering is the model's own chat template for every family (`toolcalls.render`: `tools=`,
assistant `tool_calls`, `tool` messages, as mlx_lm.server passes them). Custom tools (free text
or a grammar) have no place in these formats: a job with callable custom tools is served in the
generic format instead (`job_format`), every tool then described in the system prompt.

Parsing (`FormatParser`, the same events as `toolcalls.ToolCallParser`): the text between a
call's markers goes, once complete, to mlx-lm's `parse_tool_call` for the family, with the
tools' schemas (which several parsers use to type parameter values); each call it returns comes
out as `CallStart`, one `ArgumentsDelta` (the JSON text of its arguments) and `CallDone`. Text
that may be the beginning of a start marker is held back. A call the parser cannot read, a name
no tool has or arguments that are not an object raise `ToolCallError`. `mistral` has no end
marker: a call's text ends at the next start marker or at the end of the output.

Grammars (`family_grammar`, the same choices as `grammars.build_grammar`): the call structure
is enforced in the family's syntax, with the function names of the callable tools. Where
arguments are JSON (`mistral`, `mistral_json`, `kimi_k2`; `muse_spark` writes each parameter's value as JSON) they are `%json` with the tool's schema, strict or
lenient as for the generic format. Where they are written parameter by parameter (`qwen3_coder`,
`glm47`, `longcat`, `minimax_m2`, `minicpm5`, `muse_spark`, `kimi_k3`, `pythonic`, `gemma4`,
`function_gemma`) the grammar allows
exactly the declared parameters, in `properties` order, the required ones always, the others
optionally; a parameter of type `string` is raw text in the family's string syntax (an `enum`
of strings: one of its values), any other is JSON under its own schema (`pythonic`: a JSON
value is a Python literal). Not enforced there: constraints that span parameters (`anyOf` at
the top, `dependentRequired`…), a string parameter's `pattern`/`format`/length, and a
non-strict tool's undeclared parameters (refused, as a strict tool's) — except a non-strict
tool without `properties`, whose parameters in the XML-ish formats may have any name and raw
values. Markers that are single special tokens of the model's tokenizer are written in the
grammar as those tokens (`CallFormat.marker_ids`).
"""

from __future__ import annotations

import importlib
import json
import re
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .grammars import (
    CallFormat,
    FunctionTool,
    ResponseFormat,
    ToolSpec,
    _arguments_schema,
    _format_schema,
    _lark,
    _with_options,
)
from .toolcalls import (
    ArgumentsDelta,
    CallDone,
    CallStart,
    ContentDelta,
    ParserEvent,
    ToolCallError,
    ToolCallParser,
    _partial_suffix,
)

if TYPE_CHECKING:
    from .harmony import HarmonyParser

# The formats `toolcalls` handles itself (the generic shape).
GENERIC_SHAPED = frozenset({"generic", "json_tools"})


class _Builder:
    """Lark rules being written for one grammar."""

    def __init__(self, call_format: CallFormat) -> None:
        self.lines: list[str] = []
        self.ids = dict(call_format.marker_ids)
        self.count = 0
        self.text = False

    def lit(self, text: str) -> str:
        """`text` in the grammar: its special tokens by id, the rest literals."""
        if not text:
            return ""
        if text in self.ids:
            return f"<[{self.ids[text]}]>"
        if not self.ids:
            return json.dumps(text)
        pattern = "|".join(re.escape(m) for m in sorted(self.ids, key=len, reverse=True))
        parts = [p for p in re.split(f"({pattern})", text) if p]
        return " ".join(f"<[{self.ids[p]}]>" if p in self.ids else json.dumps(p) for p in parts)

    def rule(self, body: str, lazy: bool = False) -> str:
        self.count += 1
        name = f"r{self.count}"
        self.lines.append(f"{name}{'[lazy]' if lazy else ''}: {body}")
        return name

    def text_until(self, close: str) -> str:
        """Raw text up to (and including) the first `close`."""
        self.text = True
        if close in self.ids:
            # A special token never occurs in text.
            return f"TEXT {self.lit(close)}"
        return self.rule(f"TEXT {self.lit(close)}", lazy=True)

    def json(self, schema: Any, strict: bool) -> str:
        if not isinstance(schema, dict):
            schema = {} if schema is True else {"not": {}}
        return f"%json {json.dumps(_with_options(schema, strict))}"


def _properties(tool: FunctionTool) -> tuple[dict[str, Any], dict[str, Any], set[str]]:
    """The arguments schema (as the grammar enforces it), its properties and required names."""
    schema = _arguments_schema(tool)
    props = schema.get("properties")
    props = props if isinstance(props, dict) else {}
    required = schema.get("required")
    return schema, props, set(required) if isinstance(required, list) else set()


def _sub_schema(root: dict[str, Any], schema: Any) -> Any:
    """A property's schema, with the root's definitions its `$ref`s may point to."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for defs in ("$defs", "definitions"):
        if isinstance(root.get(defs), dict) and defs not in out:
            out[defs] = root[defs]
    return out


def _is_string(schema: Any) -> bool:
    return isinstance(schema, dict) and schema.get("type") == "string"


def _string_enum(schema: Any) -> list[str] | None:
    enum = schema.get("enum") if isinstance(schema, dict) else None
    if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
        return enum
    return None


def _sequence(b: _Builder, items: list[tuple[str, bool]], sep: str) -> str:
    """Items (expression, required) in order, each optional one possibly left out, `sep`
    (Lark, may be empty) between the items written."""
    if not items:
        return ""
    lead = f"{sep} " if sep else ""
    # afters[j]: items j.. each led by `sep` (some item was written before them).
    afters = [""] * (len(items) + 1)
    for j in range(len(items) - 1, -1, -1):
        expr, required = items[j]
        one = f"{lead}{expr}" if required else f"({lead}{expr})?"
        afters[j] = b.rule(f"{one} {afters[j + 1]}".strip())
    if not sep:
        return afters[0]
    # first[j]: items j.. with none written before.
    first = ""
    for j in range(len(items) - 1, -1, -1):
        expr, required = items[j]
        here = f"{expr} {afters[j + 1]}".strip()
        if required:
            first = b.rule(here)
        elif first:
            first = b.rule(f"{here} | {first}")
        else:
            first = b.rule(f"({here})?")
    return first


def _xml_params(
    b: _Builder,
    tool: FunctionTool,
    head: Callable[[str], str],
    close: str,
    tail: str = "",
    json_close: str = "",
    after: str = "",
) -> str:
    """The parameters of an XML-ish call: each `head(<name, Lark>)`, the value, `close`,
    `tail`."""
    schema, props, required = _properties(tool)
    end = f"{b.lit(tail)} {after}".strip()
    if not props and not tool.strict and schema.get("additionalProperties") is not False:
        name = "/[A-Za-z0-9_.\\-]{1,64}/"
        return f"({head(name)} {b.text_until(close)} {end})*"
    items = []
    for key, prop in props.items():
        start = head(json.dumps(key))
        enum = _string_enum(prop)
        if enum is not None:
            values = " | ".join(json.dumps(v) for v in enum)
            expr = f"{start} ({values}) {b.lit(json_close + close)} {end}"
        elif _is_string(prop):
            expr = f"{start} {b.text_until(close)} {end}"
        else:
            value = b.json(_sub_schema(schema, prop), tool.strict)
            expr = f"{start} {value} {b.lit(json_close + close)} {end}"
        items.append((expr.strip(), key in required))
    return _sequence(b, items, "")


def _kv_params(
    b: _Builder,
    tool: FunctionTool,
    key_text: Callable[[str], str],
    quote: str,
    sep: str,
) -> str:
    """Key-value arguments (`pythonic`, `gemma4`, `function_gemma`): each `key_text(name)` then
    the value, `sep` between; strings in `quote`s (a JSON string when `quote` is empty)."""
    schema, props, required = _properties(tool)
    items = []
    for key, prop in props.items():
        enum = _string_enum(prop)
        if quote and enum is not None:
            values = " | ".join(json.dumps(v) for v in enum)
            value = f"{b.lit(quote)} ({values}) {b.lit(quote)}"
        elif quote and _is_string(prop):
            value = f"{b.lit(quote)} {b.text_until(quote)}"
        else:
            value = b.json(_sub_schema(schema, prop), tool.strict)
        items.append((f"{json.dumps(key_text(key))} {value}", key in required))
    return _sequence(b, items, json.dumps(sep))


# --- the families ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Family:
    """One mlx-lm tool-call format.

    `start`/`end`: the markers mlx-lm's parser module names (`end` empty: a call runs to the
    next start marker or the end of the output). `grouped`: one start…end section holds every
    call (else each call has its own markers). `sep`: the Lark expression between calls.
    `opening`/`closing`: what follows the start marker and precedes the end marker. `call`: the
    Lark expression of one call of a tool. `markers`: the fixed strings that may be single
    special tokens. `parser`: the mlx-lm module whose `parse_tool_call` reads a call's text.
    """

    name: str
    start: str
    end: str
    call: Callable[[_Builder, FunctionTool], str]
    markers: tuple[str, ...] = ()
    grouped: bool = False
    sep: str = ""
    opening: str = ""
    closing: str = ""
    parser: str = ""

    def parse(self, text: str, tools: list[dict[str, Any]] | None) -> Any:
        module = importlib.import_module(f"mlx_lm.tool_parsers.{self.parser or self.name}")
        return module.parse_tool_call(text, tools)


def _qwen3_coder(b: _Builder, tool: FunctionTool) -> str:
    # A string value runs to the first `</parameter>` (its newline before it is the parser's
    # to strip), as mlx-lm's parser reads it.
    params = _xml_params(
        b, tool, lambda n: f'"<parameter=" {n} ">\\n"', "</parameter>", tail="\n", json_close="\n"
    )
    head = json.dumps(f"<function={tool.name}>" + "\n")
    return f'{head} {params} "</function>"'


_GLM_MARKERS = (
    "<tool_call>",
    "</tool_call>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
)


def _glm(prefix: str) -> Callable[[_Builder, FunctionTool], str]:
    def call(b: _Builder, tool: FunctionTool) -> str:
        key_open, key_close = f"<{prefix}arg_key>", f"</{prefix}arg_key>"
        value_open, value_close = f"<{prefix}arg_value>", f"</{prefix}arg_value>"

        def head(n: str) -> str:
            return f'{b.lit(key_open)} {n} {b.lit(key_close)} "\\n"? {b.lit(value_open)}'

        # GLM-4.5/4.6 templates put a newline after the name and each tag, 4.7's none: both.
        params = _xml_params(b, tool, head, value_close, after='"\\n"?')
        return f'{json.dumps(tool.name)} "\\n"? {params}'

    return call


def _minimax(b: _Builder, tool: FunctionTool) -> str:
    params = _xml_params(
        b, tool, lambda n: f'"<parameter name=\\"" {n} "\\">"', "</parameter>", tail="\n"
    )
    head = json.dumps(f'<invoke name="{tool.name}">' + "\n")
    return f'{head} {params} "</invoke>"'


def _minicpm(b: _Builder, tool: FunctionTool) -> str:
    # After the start marker `<function name=`: the quoted name, then the parameters.
    params = _xml_params(b, tool, lambda n: f'"<param name=\\"" {n} "\\">"', "</param>")
    return f"{json.dumps(json.dumps(tool.name) + '>')} {params}"


def _muse(b: _Builder, tool: FunctionTool) -> str:
    # Every value as JSON (mlx-lm's parser decodes a value as JSON when it can: a string
    # written raw that looks like a number would come back a number).
    schema, props, required = _properties(tool)
    items = []
    for key, prop in props.items():
        value = b.json(_sub_schema(schema, prop), tool.strict)
        head = json.dumps(f'<atem:parameter name="{key}">')
        items.append((f'{head} {value} "</atem:parameter>"', key in required))
    head = json.dumps(f'<atem:invoke name="{tool.name}">')
    return f'{head} {_sequence(b, items, "")} "</atem:invoke>"'


def _kimi_k3(b: _Builder, tool: FunctionTool) -> str:
    # XTML: typed arguments, a string raw up to the closing tag, any other value as JSON.
    schema, props, required = _properties(tool)
    items = []
    for key, prop in props.items():
        string = _is_string(prop) or _string_enum(prop) is not None
        kind = "string" if string else "json"
        head = b.lit(f'<|open|>argument key="{key}" type="{kind}"<|sep|>')
        enum = _string_enum(prop)
        if enum is not None:
            value = "(" + " | ".join(json.dumps(v) for v in enum) + ") " + b.lit("<|close|>")
        elif string:
            value = b.text_until("<|close|>")
        else:
            value = f"{b.json(_sub_schema(schema, prop), tool.strict)} {b.lit('<|close|>')}"
        items.append((f"{head} {value} {b.lit('argument<|sep|>')}", key in required))
    head = b.lit(f'<|open|>call tool="{tool.name}" index="')
    index_end = b.lit('"<|sep|>')
    close = b.lit("<|close|>call<|sep|>")
    return f"{head} /[0-9]{{1,4}}/ {index_end} {_sequence(b, items, '')} {close}"


def _mistral_json(b: _Builder, tool: FunctionTool) -> str:
    # The older Mistral templates' (v3 tokenizers) list of call objects, an id optional.
    schema = _arguments_schema(tool)
    head = json.dumps('{"name": ' + json.dumps(tool.name) + ', "arguments": ')
    call_id = '(", \\"id\\": \\"" /[A-Za-z0-9]{9}/ "\\"")?'
    return f'{head} {b.json(schema, tool.strict)} {call_id} "}}"'


def _mistral(b: _Builder, tool: FunctionTool) -> str:
    schema = _arguments_schema(tool)
    return f"{json.dumps(tool.name)} {b.lit('[ARGS]')} {b.json(schema, tool.strict)}"


def _kimi(b: _Builder, tool: FunctionTool) -> str:
    schema = _arguments_schema(tool)
    return (
        f"{b.lit('<|tool_call_begin|>')} {json.dumps('functions.' + tool.name + ':')} "
        f"/[0-9]{{1,4}}/ {b.lit('<|tool_call_argument_begin|>')} "
        f"{b.json(schema, tool.strict)} {b.lit('<|tool_call_end|>')}"
    )


def _pythonic(b: _Builder, tool: FunctionTool) -> str:
    args = _kv_params(b, tool, lambda k: f"{k}=", "", ", ")
    return f'{json.dumps(tool.name + "(")} {args} ")"'


def _gemma(quote: str) -> Callable[[_Builder, FunctionTool], str]:
    def call(b: _Builder, tool: FunctionTool) -> str:
        args = _kv_params(b, tool, lambda k: f"{k}:", quote, ",")
        return f'{json.dumps("call:" + tool.name + "{")} {args} "}}"'

    return call


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family(
            "qwen3_coder",
            "<tool_call>",
            "</tool_call>",
            _qwen3_coder,
            ("<tool_call>", "</tool_call>"),
            sep='"\\n"',
            opening="\n",
            closing="\n",
        ),
        # laguna writes glm47's calls (mlx-lm has a parser of each name).
        *(
            Family(
                name,
                "<tool_call>",
                "</tool_call>",
                _glm(""),
                _GLM_MARKERS,
                sep='"\\n"?',
            )
            for name in ("glm47", "laguna")
        ),
        Family(
            "longcat",
            "<longcat_tool_call>",
            "</longcat_tool_call>",
            _glm("longcat_"),
            (
                "<longcat_tool_call>",
                "</longcat_tool_call>",
                "<longcat_arg_key>",
                "</longcat_arg_key>",
                "<longcat_arg_value>",
                "</longcat_arg_value>",
            ),
            sep='"\\n"?',
        ),
        Family(
            "minimax_m2",
            "<minimax:tool_call>",
            "</minimax:tool_call>",
            _minimax,
            ("<minimax:tool_call>", "</minimax:tool_call>"),
            grouped=True,
            sep='"\\n"',
            opening="\n",
            closing="\n",
        ),
        Family("mistral", "[TOOL_CALLS]", "", _mistral, ("[TOOL_CALLS]", "[ARGS]")),
        # Mistral's older templates (no [ARGS]): `[TOOL_CALLS] [{"name": …, "arguments": …}]`,
        # read by the same mlx-lm parser (`call_format_of` picks it from the template).
        Family(
            "mistral_json",
            "[TOOL_CALLS]",
            "",
            _mistral_json,
            ("[TOOL_CALLS]",),
            grouped=True,
            sep='", "',
            opening=" [",
            closing="]",
            parser="mistral",
        ),
        Family("minicpm5", "<function name=", "</function>", _minicpm, sep='"\\n"?'),
        Family(
            "muse_spark",
            "<atem:function_calls>",
            "</atem:function_calls>",
            _muse,
            ("<atem:function_calls>", "</atem:function_calls>"),
            grouped=True,
        ),
        Family(
            "kimi_k2",
            "<|tool_calls_section_begin|>",
            "<|tool_calls_section_end|>",
            _kimi,
            (
                "<|tool_calls_section_begin|>",
                "<|tool_calls_section_end|>",
                "<|tool_call_begin|>",
                "<|tool_call_argument_begin|>",
                "<|tool_call_end|>",
            ),
            grouped=True,
        ),
        Family(
            "kimi_k3",
            "<|open|>tools<|sep|>",
            "<|close|>tools<|sep|>",
            _kimi_k3,
            ("<|open|>", "<|close|>", "<|sep|>"),
            grouped=True,
        ),
        Family(
            "pythonic",
            "<|tool_call_start|>",
            "<|tool_call_end|>",
            _pythonic,
            ("<|tool_call_start|>", "<|tool_call_end|>"),
            grouped=True,
            sep='", "',
            opening="[",
            closing="]",
        ),
        Family(
            "gemma4",
            "<|tool_call>",
            "<tool_call|>",
            _gemma('<|"|>'),
            ("<|tool_call>", "<tool_call|>", '<|"|>'),
        ),
        Family(
            "function_gemma",
            "<start_function_call>",
            "<end_function_call>",
            _gemma("<escape>"),
            ("<start_function_call>", "<end_function_call>", "<escape>"),
        ),
    )
}


def family_name(tool_parser_type: str, chat_template: Any) -> str:
    """The family of a model whose mlx-lm parser is `tool_parser_type`: the parser's name, but
    "mistral_json" for a Mistral template that writes calls as a JSON list (no `[ARGS]`)."""
    if (
        tool_parser_type == "mistral"
        and isinstance(chat_template, str)
        and "[ARGS]" not in chat_template
    ):
        return "mistral_json"
    return tool_parser_type


def family_format(name: str, marker_ids: tuple[tuple[str, int], ...] = ()) -> CallFormat:
    """The `CallFormat` of family `name` (its markers; `marker_ids` those that are special
    tokens)."""
    family = FAMILIES[name]
    return CallFormat(name, family.start, family.end, bool(marker_ids), marker_ids)


def job_format(call_format: CallFormat, tools: ToolSpec | None) -> CallFormat:
    """The format a job is served in: the model's, or the generic one when the job has callable
    custom tools and the model's format has no place for them."""
    from .grammars import GENERIC

    # (harmony's output is in channels whatever the format: its custom tools are refused at
    # admission, `formatcheck`.)
    if (
        call_format.name not in (*GENERIC_SHAPED, "harmony")
        and tools is not None
        and tools.active
        and tools.callable_customs()
    ):
        return GENERIC
    return call_format


def hf_tools(tools: ToolSpec | None) -> list[dict[str, Any]] | None:
    """The function tools in the shape chat templates and mlx-lm's parsers take."""
    if tools is None or not tools.tools:
        return None
    return [
        {
            "type": "function",
            "function": {
                "name": tool.name,
                "description": tool.description or "",
                "parameters": tool.parameters or {"type": "object", "properties": {}},
            },
        }
        for tool in tools.tools
    ]


# --- grammars -------------------------------------------------------------------------------


def family_grammar(
    response_format: ResponseFormat | None, tools: ToolSpec, call_format: CallFormat
) -> str:
    """The grammar of a job whose calls are in a family's format (see the module docstring);
    the choices are `grammars.build_grammar`'s."""
    family = FAMILIES[call_format.name]
    b = _Builder(call_format)
    functions = tools.callable_tools()
    if not functions:
        raise ValueError(f"no function to call in the {family.name} format")
    alternatives = [b.rule(family.call(b, tool)) for tool in functions]
    call = b.rule(" | ".join(alternatives))
    limit = tools.call_limit
    close = f"{b.lit(family.closing)} {b.lit(family.end)}"
    if family.grouped:
        unit, head, tail = call, f"{b.lit(family.opening)} {call}", close
    else:
        unit = f"{b.lit(family.start)} {b.lit(family.opening)} {call} {close}"
        head, tail = f"{b.lit(family.opening)} {call} {close}", ""
    repeat = f"({family.sep} {unit})"
    more = "" if limit == 1 else f"{repeat}*" if limit is None else f"{repeat}{{0,{limit - 1}}}"
    # The calls after the first start marker (which `start` writes).
    first = b.rule(f"{head} {more} {tail}")
    trailing = ' "\\n"?' if family.end else ""
    start_marker = b.lit(family.start)
    if tools.choice == "auto":
        b.text = True
    if response_format is not None:
        schema = _with_options(_format_schema(response_format), response_format.strict)
        b.lines.append(f"answer: %json {json.dumps(schema)}")
        b.lines.append(f"start: answer | {start_marker} {first}{trailing}")
    elif tools.choice == "auto":
        if any(marker in family.start for marker in b.ids):
            b.lines.append(f"start: TEXT | TEXT {start_marker} {first}{trailing}")
        else:
            b.lines.append(f"call_head[lazy]: TEXT {start_marker}")
            b.lines.append(f"start: TEXT | call_head {first}{trailing}")
    else:
        b.lines.append(f"start: {start_marker} {first}{trailing}")
    if b.text:
        b.lines.append("TEXT: /(?s:.*)/")
    return _lark("%llguidance {}\n" + "\n".join(b.lines))


# --- parsing --------------------------------------------------------------------------------


class FormatParser:
    """`toolcalls.ToolCallParser` for a family's format (see the module docstring): `feed`,
    `finish`, `in_call`, `calls`. `names`, when given, are the only function names accepted;
    `tools` (their schemas) are given to mlx-lm's parser, which types values with them."""

    def __init__(
        self,
        family: Family,
        names: Collection[str] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> None:
        self.family = family
        self._names = set(names) if names is not None else None
        self._tools = tools
        self._buffer = ""
        self._in_call = False
        self.calls: list[CallDone] = []

    @property
    def in_call(self) -> bool:
        return self._in_call

    def feed(self, text: str) -> list[ParserEvent]:
        self._buffer += text
        events: list[ParserEvent] = []
        start, end = self.family.start, self.family.end
        while True:
            if not self._in_call:
                at = self._buffer.find(start)
                if at < 0:
                    keep = _partial_suffix(self._buffer, start)
                    self._content(self._buffer[: len(self._buffer) - keep], events)
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    return events
                self._content(self._buffer[:at], events)
                self._buffer = self._buffer[at + len(start) :]
                self._in_call = True
                continue
            if end:
                close = self._buffer.find(end)
                if close < 0:
                    return events
                body, self._buffer = self._buffer[:close], self._buffer[close + len(end) :]
            else:
                # No end marker: the call ends where the next one starts.
                close = self._buffer.find(start)
                if close < 0:
                    return events
                body, self._buffer = self._buffer[:close], self._buffer[close:]
            self._in_call = False
            self._read(body, events)

    def finish(self) -> list[ParserEvent]:
        events: list[ParserEvent] = []
        if self._in_call:
            if self.family.end:
                raise ToolCallError(
                    f"the output ended inside tool call {len(self.calls)} "
                    f"(no {self.family.end}): {self._buffer[:200]!r}"
                )
            body, self._buffer = self._buffer, ""
            self._in_call = False
            self._read(body, events)
            return events
        self._content(self._buffer, events)
        self._buffer = ""
        return events

    def _content(self, text: str, events: list[ParserEvent]) -> None:
        if not text or (self.calls and not text.strip()):
            return
        events.append(ContentDelta(text))

    def _read(self, body: str, events: list[ParserEvent]) -> None:
        index = len(self.calls)
        try:
            if self.family.name == "longcat" and "<longcat_arg_key>" not in body:
                # mlx-lm's longcat parser needs an argument; a call without one is its name.
                parsed: Any = {"name": body.strip(), "arguments": {}}
            else:
                parsed = self.family.parse(body, self._tools)
        except Exception as exc:  # the parsers raise what their libraries raise
            raise ToolCallError(
                f"tool call {index} cannot be read as {self.family.name}: {exc}: {body[:200]!r}"
            ) from exc
        found = parsed if isinstance(parsed, list) else [parsed]
        if not found:
            raise ToolCallError(f"tool call {index} holds no call: {body[:200]!r}")
        if self.family.name == "kimi_k3" and body.count("<|open|>call") != len(found):
            # mlx-lm's kimi_k3 parser skips a call it cannot read: never drop one.
            raise ToolCallError(f"a tool call from {index} on cannot be read: {body[:200]!r}")
        for call in found:
            index = len(self.calls)
            if not isinstance(call, dict):
                raise ToolCallError(f"tool call {index} is malformed: {body[:200]!r}")
            name, arguments = call.get("name"), call.get("arguments", {})
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments)
                except ValueError as exc:
                    raise ToolCallError(f"tool call {index}: bad arguments {arguments!r}") from exc
            if not isinstance(name, str) or (self._names is not None and name not in self._names):
                raise ToolCallError(f"tool call {index} names an unknown function: {name!r}")
            if not isinstance(arguments, dict):
                raise ToolCallError(
                    f"tool call {index}'s arguments are not an object: {body[:200]!r}"
                )
            text = json.dumps(arguments, ensure_ascii=False)
            done = CallDone(index, name, text)
            events += [CallStart(index, name), ArgumentsDelta(index, text), done]
            self.calls.append(done)


def make_parser(
    tool_format: str,
    names: Collection[str] | None = None,
    customs: Collection[str] = (),
    tools: ToolSpec | None = None,
) -> ToolCallParser | FormatParser | HarmonyParser:
    """The streaming parser for a format named as `JobStarted.tool_format` names it."""
    if tool_format == "harmony":
        from .harmony import HarmonyParser

        # A harmony model's output is parsed with or without tools: no tools, no call.
        allowed = names if names is not None else [t.name for t in tools.tools] if tools else []
        return HarmonyParser(allowed)
    family = FAMILIES.get(tool_format)
    if family is None:
        return ToolCallParser(CallFormat(tool_format), names, customs=customs)
    return FormatParser(family, names, hf_tools(tools))


__all__ = [
    "FAMILIES",
    "Family",
    "FormatParser",
    "family_format",
    "family_grammar",
    "hf_tools",
    "job_format",
    "make_parser",
]
