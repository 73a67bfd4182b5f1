"""Function calls in a model's text: putting tools into the prompt, and getting calls back out.

Pure (no MLX). The engine's chat messages may carry calls and their results:

- `{"role": "assistant", "content": str | None, "tool_calls": [{"id", "name", "arguments"}]}`,
  `arguments` being the JSON text of the call's arguments;
- `{"role": "tool", "tool_call_id": str, "content": str}` (optionally `"name"`).

`render` turns those and a `ToolSpec` into what the model's chat template takes. With the
generic format (`grammars.GENERIC`, for a model whose template knows no tools, like the demo
model's) the tools are described in the system prompt, past calls become the assistant's text
(`<tool_call>\\n{"name": …, "arguments": …}\\n</tool_call>`, exactly as the model writes them)
and results become a user message of `<tool_response>` blocks, so any template renders them.
With the model's own format ("json_tools", the Hermes/Qwen shape, same text, or another mlx-lm
format: `callformats`) the template gets `tools=` and the messages in the Hugging Face shape and
renders them itself.

A custom tool's call (`grammars.CustomTool`) carries raw text rather than JSON arguments: in
the messages it is `{"id", "name", "input"}`, and in the model's text `<tool_call>\n{"name":
…}\n<input>\n</tool_call>`; both formats render it as that text (a template would write it as
JSON), and its tool is described in the system prompt.

`ToolCallParser` turns the generated text, as it streams, into content text and calls (name,
argument or input deltas, done). It raises `ToolCallError` on a call it cannot parse, never dropping it.
Feeding it the same text gives the same events, so after a resume the caller can re-feed the
committed text and skip the events it already has.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from jupyter_lmsp.engine.grammars import GENERIC, CallFormat, ToolSpec

# The mlx-lm tool parsers whose call text is the generic format's: a model trained on one of
# them is prompted through its own template and parsed here.
NATIVE_FORMATS = frozenset({"json_tools"})

TOOLS_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a JSON object with the function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def call_format_for(
    tool_parser_type: str | None,
    *,
    special_markers: bool = False,
    marker_ids: tuple[tuple[str, int], ...] = (),
    tools: ToolSpec | None = None,
) -> CallFormat:
    """The call format of a model whose tokenizer mlx-lm gave `tool_parser_type`: the generic
    shape's (`NATIVE_FORMATS`), another format mlx-lm knows (`callformats.FAMILIES`, with its
    special markers' ids), else the generic one. With `tools` that hold callable custom tools,
    a format that has no place for them gives way to the generic one (`callformats.job_format`).
    """
    from .callformats import FAMILIES, family_format, job_format

    if tool_parser_type in NATIVE_FORMATS:
        return CallFormat(tool_parser_type, special_markers=special_markers)
    if tool_parser_type in FAMILIES:
        return job_format(family_format(tool_parser_type, marker_ids), tools)
    return GENERIC


def call_text(name: str, arguments: str) -> str:
    """The JSON object of one call as the grammar has the model write it."""
    return '{"name": ' + json.dumps(name) + ', "arguments": ' + arguments + "}"


def custom_call_text(name: str, text: str) -> str:
    """A custom tool call's body as the grammar has the model write it: its name, then its
    input on the following lines."""
    return '{"name": ' + json.dumps(name) + "}\n" + text


def written_call(call: dict[str, Any], call_format: CallFormat) -> str:
    """One call of an assistant message as the model writes it, markers included."""
    if "input" in call:
        body = custom_call_text(call["name"], call["input"])
    else:
        body = call_text(call["name"], call["arguments"])
    return f"{call_format.start}\n{body}\n{call_format.end}"


CUSTOM_TOOLS_PROMPT = """# Custom tools

These tools take plain text instead of JSON arguments. To call one, write its name as a JSON \
object, then the input as plain text on the lines that follow:
<tool_call>
{{"name": <tool-name>}}
<input>
</tool_call>

An input with a grammar must be a sentence of that grammar, written exactly.
<custom_tools>
{tools}
</custom_tools>"""


def custom_tools_prompt(tools: ToolSpec) -> str:
    lines = []
    for tool in tools.callable_customs():
        entry: dict[str, Any] = {"name": tool.name}
        if tool.description:
            entry["description"] = tool.description
        if tool.syntax == "text":
            entry["input"] = "free text"
        else:
            entry["input"] = {"grammar": tool.syntax, "definition": tool.definition}
        lines.append(json.dumps(entry))
    return CUSTOM_TOOLS_PROMPT.format(tools="\n".join(lines))


def render(
    messages: list[dict[str, Any]], tools: ToolSpec | None, call_format: CallFormat = GENERIC
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages and extra chat-template arguments for a job with (or without) tools.

    Tools are shown only when calls are possible (`tools.active`); past calls and results are
    rendered either way.
    """
    show = tools is not None and tools.active
    if call_format.name != GENERIC.name:
        rendered, extra = _render_native(messages, tools if show else None)
        if call_format.name == "harmony":
            # gpt-oss's template shows earlier thinking from `thinking` (`harmony`).
            for message in rendered:
                if message.get("reasoning_content"):
                    message["thinking"] = message["reasoning_content"]
        return rendered, extra
    return _render_generic(messages, tools if show else None, call_format), {}


def tools_prompt(tools: ToolSpec) -> str:
    lines = []
    for tool in tools.callable_tools():
        function: dict[str, Any] = {"name": tool.name}
        if tool.description:
            function["description"] = tool.description
        function["parameters"] = tool.parameters or {"type": "object", "properties": {}}
        lines.append(json.dumps({"type": "function", "function": function}))
    return TOOLS_PROMPT.format(tools="\n".join(lines))


def _render_generic(
    messages: list[dict[str, Any]], tools: ToolSpec | None, call_format: CallFormat
) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for message in messages:
        role = message.get("role")
        content = message.get("content") or ""
        if role == "assistant" and message.get("tool_calls"):
            calls = "\n".join(written_call(c, call_format) for c in message["tool_calls"])
            out.append({"role": "assistant", "content": f"{content}{calls}"})
        elif role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            previous = out[-1] if out else None
            if previous is not None and previous.get("_results"):
                previous["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_results": True})
        else:
            out.append({"role": role, "content": content})
        if role == "assistant" and message.get("reasoning_content"):
            out[-1]["reasoning_content"] = message["reasoning_content"]
    for message in out:
        message.pop("_results", None)
    if tools is not None:
        parts = []
        if tools.callable_tools():
            parts.append(tools_prompt(tools))
        if tools.callable_customs():
            parts.append(custom_tools_prompt(tools))
        _add_system(out, "\n\n".join(parts))
    return out


def _add_system(messages: list[dict[str, Any]], prompt: str) -> None:
    if not prompt:
        return
    if messages and messages[0]["role"] == "system":
        messages[0] = {"role": "system", "content": f"{messages[0]['content']}\n\n{prompt}"}
    else:
        messages.insert(0, {"role": "system", "content": prompt})


def _render_native(
    messages: list[dict[str, Any]], tools: ToolSpec | None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for message in messages:
        role = message.get("role")
        content = message.get("content") or ""
        if role == "assistant" and any("input" in c for c in message.get("tool_calls") or ()):
            # A custom call has no JSON arguments for the template to write: the message is
            # given as the model wrote it (the same text a native call has).
            calls_text = "\n".join(written_call(c, GENERIC) for c in message["tool_calls"])
            out.append({"role": "assistant", "content": f"{content}{calls_text}"})
        elif role == "assistant" and message.get("tool_calls"):
            calls = []
            for call in message["tool_calls"]:
                try:
                    arguments: Any = json.loads(call["arguments"])
                except (TypeError, ValueError):
                    arguments = call["arguments"]
                calls.append(
                    {
                        "id": call.get("id"),
                        "type": "function",
                        "function": {"name": call["name"], "arguments": arguments},
                    }
                )
            out.append({"role": "assistant", "content": content, "tool_calls": calls})
        elif role == "tool":
            result = {"role": "tool", "content": content}
            for key in ("tool_call_id", "name"):
                if message.get(key) is not None:
                    result[key] = message[key]
            out.append(result)
        else:
            out.append({"role": role, "content": content})
        if role == "assistant" and message.get("reasoning_content"):
            # A thinking model's template may show its earlier thinking (Qwen3's does, for
            # the turns after the last user message).
            out[-1]["reasoning_content"] = message["reasoning_content"]
    extra: dict[str, Any] = {}
    if tools is not None and tools.callable_tools():
        extra["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": tool.name,
                    "description": tool.description or "",
                    "parameters": tool.parameters or {"type": "object", "properties": {}},
                },
            }
            for tool in tools.callable_tools()
        ]
    if tools is not None and tools.callable_customs():
        _add_system(out, custom_tools_prompt(tools))
    return out, extra


# --- parsing --------------------------------------------------------------------------------


@dataclass
class ContentDelta:
    """Text of the message that is not part of a call."""

    text: str


@dataclass
class CallStart:
    """Call `index` (0-based, in order) began; its function (or custom tool, `custom`) is
    `name`."""

    index: int
    name: str
    custom: bool = False


@dataclass
class ArgumentsDelta:
    """More of call `index`'s arguments text (a custom call's input); the deltas add up to
    `CallDone.arguments`."""

    index: int
    delta: str


@dataclass
class CallDone:
    """Call `index` is complete: `arguments` is its arguments' JSON text (an object), or a
    custom call's input text."""

    index: int
    name: str
    arguments: str
    custom: bool = False


ParserEvent = ContentDelta | CallStart | ArgumentsDelta | CallDone


class ToolCallError(ValueError):
    """The text holds a call that cannot be parsed (or ended inside one)."""


_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')
# A custom tool call's head: its name alone, then its input from the next line on.
_CUSTOM_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*\}\n')


class ToolCallParser:
    """Splits streamed text into content and calls (see the module docstring).

    `feed` takes the next piece of text and returns the events it completes; `finish` ends the
    text (raising `ToolCallError` if it ends inside a call). Content that could be the start of
    a call marker is held back until it is known not to be. `names`, when given, are the only
    function names accepted; `customs` are the custom tools' names (their calls carry text).
    """

    def __init__(
        self,
        call_format: CallFormat = GENERIC,
        names: Collection[str] | None = None,
        customs: Collection[str] = (),
    ) -> None:
        self._start = call_format.start
        self._end = call_format.end
        self._names = set(names) if names is not None else None
        self._customs = set(customs)
        self._custom = False
        self._buffer = ""
        self._in_call = False
        self.calls: list[CallDone] = []
        # The call being read: its name once known, and how much of its arguments went out.
        self._name: str | None = None
        self._args_start = 0
        self._args_sent = 0
        self._args_end: int | None = None

    @property
    def in_call(self) -> bool:
        """Whether the text so far ends inside a call (its start marker seen, not its end)."""
        return self._in_call

    def feed(self, text: str) -> list[ParserEvent]:
        self._buffer += text
        events: list[ParserEvent] = []
        while True:
            if self._in_call:
                if not self._read_call(events):
                    return events
            else:
                at = self._buffer.find(self._start)
                if at < 0:
                    keep = _partial_suffix(self._buffer, self._start)
                    self._content(self._buffer[: len(self._buffer) - keep], events)
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    return events
                self._content(self._buffer[:at], events)
                self._buffer = self._buffer[at + len(self._start) :]
                self._in_call = True
                self._name, self._args_start, self._args_sent = None, 0, 0
                self._args_end = None
                self._custom = False

    def finish(self) -> list[ParserEvent]:
        if self._in_call:
            raise ToolCallError(
                f"the output ended inside tool call {len(self.calls)} "
                f"(no {self._end}): {self._buffer[:200]!r}"
            )
        events: list[ParserEvent] = []
        self._content(self._buffer, events)
        self._buffer = ""
        return events

    def _content(self, text: str, events: list[ParserEvent]) -> None:
        if not text:
            return
        if self.calls and not text.strip():
            return  # the newlines between and after calls
        events.append(ContentDelta(text))

    def _read_call(self, events: list[ParserEvent]) -> bool:
        """Advance the call in the buffer; True once it is done (the buffer then holds what
        follows it)."""
        index = len(self.calls)
        if self._name is None and self._customs:
            custom = _CUSTOM_HEAD.match(self._buffer)
            if custom is not None:
                try:
                    name = json.loads(custom.group(1))
                except ValueError as exc:
                    raise ToolCallError(f"tool call {index}: bad name {custom.group(1)}") from exc
                if name not in self._customs:
                    raise ToolCallError(f"tool call {index} names no custom tool: {name!r}")
                self._name, self._custom = name, True
                self._args_start = self._args_sent = custom.end()
                events.append(CallStart(index, name, custom=True))
        if self._custom:
            return self._read_input(index, events)
        if self._name is None:
            head = _HEAD.match(self._buffer)
            if head is not None:
                try:
                    name = json.loads(head.group(1))
                except ValueError as exc:
                    raise ToolCallError(f"tool call {index}: bad name {head.group(1)}") from exc
                self._check_name(index, name)
                self._name = name
                self._args_start = self._args_sent = head.end()
                events.append(CallStart(index, name))
        if self._name is not None and self._args_end is None:
            if self._args_sent == self._args_start:
                # Nothing sent yet: the arguments begin at their first non-space character.
                while (
                    self._args_start < len(self._buffer)
                    and self._buffer[self._args_start].isspace()
                ):
                    self._args_start += 1
                self._args_sent = self._args_start
            if self._buffer.startswith("{", self._args_start):
                end = _json_object_end(self._buffer, self._args_start)
                stop = end if end is not None else len(self._buffer)
                if stop > self._args_sent:
                    events.append(ArgumentsDelta(index, self._buffer[self._args_sent : stop]))
                    self._args_sent = stop
                self._args_end = end
        close = self._buffer.find(self._end)
        if close < 0:
            return False
        body = self._buffer[:close]
        self._buffer = self._buffer[close + len(self._end) :]
        self._in_call = False
        try:
            call = json.loads(body)
        except ValueError as exc:
            raise ToolCallError(f"tool call {index} is not valid JSON: {body[:200]!r}") from exc
        if (
            not isinstance(call, dict)
            or not isinstance(call.get("name"), str)
            or not isinstance(call.get("arguments"), dict)
        ):
            raise ToolCallError(
                f'tool call {index} must be {{"name": <string>, "arguments": <object>}}: '
                f"{body[:200]!r}"
            )
        if self._name is None:
            # Not in the streamed shape (e.g. "arguments" first): out in one piece.
            self._check_name(index, call["name"])
            arguments = json.dumps(call["arguments"])
            events += [CallStart(index, call["name"]), ArgumentsDelta(index, arguments)]
        elif self._args_end is None or call["name"] != self._name:
            raise ToolCallError(f"tool call {index} is malformed: {body[:200]!r}")
        else:
            arguments = body[self._args_start : self._args_end]
        done = CallDone(index, call["name"], arguments)
        self.calls.append(done)
        events.append(done)
        return True

    def _read_input(self, index: int, events: list[ParserEvent]) -> bool:
        """Advance a custom call's input: it runs to the end marker (a newline just before
        the marker is the call's, not the input's); what may still turn out to be that newline
        and marker is held back."""
        assert self._name is not None
        close = self._buffer.find(self._end, self._args_start)
        if close < 0:
            pending = self._buffer[self._args_sent :]
            stop = len(self._buffer) - _partial_suffix(pending, "\n" + self._end)
        else:
            stop = close - 1 if self._buffer.startswith("\n", close - 1) else close
            stop = max(stop, self._args_start)
        if stop > self._args_sent:
            events.append(ArgumentsDelta(index, self._buffer[self._args_sent : stop]))
            self._args_sent = stop
        if close < 0:
            return False
        done = CallDone(index, self._name, self._buffer[self._args_start : stop], custom=True)
        self._buffer = self._buffer[close + len(self._end) :]
        self._in_call = self._custom = False
        self.calls.append(done)
        events.append(done)
        return True

    def _check_name(self, index: int, name: object) -> None:
        if not isinstance(name, str) or (self._names is not None and name not in self._names):
            raise ToolCallError(f"tool call {index} names an unknown function: {name!r}")


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper beginning of `marker`."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


def _json_object_end(text: str, start: int) -> int | None:
    """Where the JSON object starting at `text[start]` ends, if it does within `text`."""
    depth = 0
    in_string = escaped = False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None
