"""gpt-oss's harmony format (issue 37): channels, recipients, and the grammar in their shape.

A gpt-oss model writes messages, each a header and a body:
`<|start|>assistant<|channel|>analysis<|message|>…<|end|>` (its thinking),
`<|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{…}<|call|>`
(a function call) and `<|start|>assistant<|channel|>final<|message|>…<|return|>` (the answer);
the generation prompt ends with `<|start|>assistant`, so the first message's header begins at
`<|channel|>`. `<|call|>` and `<|return|>` are end-of-sequence tokens of its generation config:
they end the output and are not in its text.

Why not the `openai-harmony` package: its encoding is o200k_harmony, which it loads from the
o200k_base vocabulary file, downloaded at run time (or from a local copy whose SHA-256 it
checks), and its parser reads token ids of that encoding. Here a model's tokenizer is the one
its checkpoint ships (an MLX conversion's tokenizer.json); downloading a second copy of the
vocabulary at inference time is what this service does not do, and a tokenizer made by the
tests cannot carry o200k's ids. The format is read from the text instead: the worker's
detokenizer keeps special tokens in the text, and the markers are the tokenizer's own special
tokens, so a harmony model is recognised by its vocabulary (`is_harmony`, every marker a
token), as mlx-lm recognises thinking markers, whatever the ids.

- **Thinking**: the analysis channel. mlx-lm infers no thinking markers for gpt-oss; `Thinking.of`
  takes `<|channel|>analysis<|message|>` … `<|end|>` as the block (`thinking.HARMONY_THINKING`),
  so the reasoning item, the reasoning token count, the thinking budget and grammars after
  thinking work as for any thinking model. An analysis message after another message (rare)
  is reasoning too (`ReasoningDelta`).
- **Effort**: the template's `reasoning_effort` ("low", "medium", "high"), `reasoning.effort_args`.
- **Parsing** (`HarmonyParser`, the events of `toolcalls.ToolCallParser`): a final message's
  body and a commentary message without recipient (a preamble to the user) are the message's
  text; a message to `functions.NAME` is a call, its body the JSON object of its arguments; a
  recipient outside `functions.` (gpt-oss's built-in browser and python tools) is refused as
  an unknown tool. A call's body ends at `<|call|>` or the end of the output.
- **Grammar** (`harmony_grammar`): a call as gpt-oss writes one (`<|channel|>commentary
  to=functions.NAME <|constrain|>json<|message|>`) or as its chat template does
  (`<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>`), then `%json`
  with the tool's schema; an answer
  as a final message (its text free, or `%json` with the response format's schema). One call
  per output: `<|call|>` ends the generation, so parallel calls are not possible here.
- **Custom tools**: the format has no place for them; a request with callable custom tools for
  a harmony model is refused at admission (`formatcheck`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from .grammars import (
    CallFormat,
    ResponseFormat,
    ToolSpec,
    _arguments_schema,
    _format_schema,
    _lark,
    _with_options,
)
from .thinking import HARMONY_MARKERS
from .toolcalls import (
    ArgumentsDelta,
    CallDone,
    CallStart,
    ContentDelta,
    ParserEvent,
    ToolCallError,
    _partial_suffix,
)

NAME = "harmony"
START, CHANNEL, MESSAGE, END, CALL, RETURN, CONSTRAIN = (
    "<|start|>",
    "<|channel|>",
    "<|message|>",
    "<|end|>",
    "<|call|>",
    "<|return|>",
    "<|constrain|>",
)
# What ends a message's body (`<|start|>` too: a header that follows without `<|end|>`).
_BODY_ENDS = (END, RETURN, CALL, START)
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_HEADER_LIMIT = 512
# How a header may begin: a marker, or (the first message, after the prompt's
# `<|start|>assistant`) its recipient.
_HEADS = ("<|", "to=")


def is_harmony(tokenizer: Any) -> bool:
    """Whether a tokenizer (mlx-lm's `TokenizerWrapper` or a Hugging Face one) has every
    harmony marker as a token of its own."""
    try:
        ids = tokenizer.convert_tokens_to_ids(list(HARMONY_MARKERS))
    except Exception:  # a tokenizer without the method: not a gpt-oss one
        return False
    unk = getattr(tokenizer, "unk_token_id", None)
    return all(isinstance(i, int) and i != unk for i in ids)


def harmony_format(marker_ids: tuple[tuple[str, int], ...] = ()) -> CallFormat:
    """The `CallFormat` of a harmony model (`marker_ids`: its markers that are special
    tokens)."""
    return CallFormat(NAME, START, CALL, bool(marker_ids), marker_ids)


@dataclass
class ReasoningDelta:
    """Thinking found after the first message (an analysis message later in the output)."""

    text: str


HarmonyEvent = ParserEvent | ReasoningDelta


class HarmonyParser:
    """`toolcalls.ToolCallParser` for harmony text (see the module docstring): `feed`, `finish`,
    `in_call`, `calls`. `names` are the functions that may be called (none: no call is)."""

    def __init__(self, names: Collection[str] = ()) -> None:
        self._names = set(names)
        self._buffer = ""
        self._header: str | None = ""  # None: in a body
        self._kind = ""  # the body's: "text", "reasoning" or "call"
        self._recipient = ""
        self._body = ""
        self.calls: list[CallDone] = []

    @property
    def in_call(self) -> bool:
        """Whether the output so far ends inside a message's header or a call's body (cut there
        by the token limit, it stays incomplete)."""
        return bool(self._header and self._header.strip()) or (
            self._header is None and self._kind == "call"
        )

    def feed(self, text: str) -> list[HarmonyEvent]:
        self._buffer += text
        events: list[HarmonyEvent] = []
        while self._buffer:
            if self._header is not None:
                if not self._read_header(events):
                    return events
            elif not self._read_body(events):
                return events
        return events

    def finish(self) -> list[HarmonyEvent]:
        events: list[HarmonyEvent] = []
        if self._header is None:
            self._emit_body(self._buffer, events)
            self._buffer = ""
            self._end_body(events)
        else:
            pending = self._header + self._buffer
            if _RECIPIENT.search(pending):
                raise ToolCallError(f"the output ended in the header of a call: {pending!r}")
            if pending.strip() and START not in pending and CHANNEL not in pending:
                # Not a header after all (text that began like one): the answer's text.
                self._kind = "text"
                self._emit_body(pending, events)
        self._header, self._buffer, self._kind = "", "", ""
        return events

    # --- headers ---

    def _read_header(self, events: list[HarmonyEvent]) -> bool:
        """Take a header from the buffer; False when more text is needed."""
        assert self._header is not None
        whole = self._header + self._buffer
        at = whole.find(MESSAGE)
        if at < 0:
            lead = whole.lstrip()
            if lead and not any(lead.startswith(p) or p.startswith(lead) for p in _HEADS):
                # Text without a header (a model that skipped it): the answer's text.
                self._header, self._buffer = None, whole
                self._kind, self._recipient = "text", ""
                return True
            if len(whole) > _HEADER_LIMIT:
                raise ToolCallError(f"a message header never ends: {whole[:200]!r}")
            self._header, self._buffer = whole, ""
            return False
        header, self._buffer = whole[:at], whole[at + len(MESSAGE) :]
        self._header = None
        self._body = ""
        channel = ""
        if CHANNEL in header:
            channel = re.split(r"[\s<]", header.split(CHANNEL, 1)[1], maxsplit=1)[0]
        found = _RECIPIENT.search(header)
        self._recipient = found.group(1) if found else ""
        if self._recipient and self._recipient != "assistant":
            self._kind = "call"
        elif channel == "analysis":
            self._kind = "reasoning"
        else:
            # final, or commentary without a recipient (a preamble to the user).
            self._kind = "text"
        return True

    # --- bodies ---

    def _read_body(self, events: list[HarmonyEvent]) -> bool:
        ends = [(self._buffer.find(m), m) for m in _BODY_ENDS if m in self._buffer]
        if not ends:
            keep = max(_partial_suffix(self._buffer, m) for m in _BODY_ENDS)
            self._emit_body(self._buffer[: len(self._buffer) - keep], events)
            self._buffer = self._buffer[len(self._buffer) - keep :]
            return False
        at, marker = min(ends)
        self._emit_body(self._buffer[:at], events)
        # `<|start|>` begins the next header; the other markers are consumed.
        self._buffer = self._buffer[at:] if marker == START else self._buffer[at + len(marker) :]
        self._end_body(events)
        return True

    def _emit_body(self, text: str, events: list[HarmonyEvent]) -> None:
        if not text:
            return
        if self._kind == "call":
            self._body += text
        elif self._kind == "reasoning":
            events.append(ReasoningDelta(text))
        elif not (self.calls and not text.strip()):
            events.append(ContentDelta(text))

    def _end_body(self, events: list[HarmonyEvent]) -> None:
        if self._kind == "call":
            self._call(events)
        self._header, self._kind, self._recipient, self._body = "", "", "", ""

    def _call(self, events: list[HarmonyEvent]) -> None:
        index = len(self.calls)
        recipient, body = self._recipient, self._body
        name = recipient.removeprefix("functions.")
        if not recipient.startswith("functions.") or name not in self._names:
            raise ToolCallError(f"tool call {index} is to an unknown tool: {recipient!r}")
        try:
            arguments = json.loads(body) if body.strip() else {}
        except ValueError as exc:
            raise ToolCallError(f"tool call {index}: bad arguments {body[:200]!r}") from exc
        if not isinstance(arguments, dict):
            raise ToolCallError(f"tool call {index}'s arguments are not an object: {body[:200]!r}")
        text = json.dumps(arguments, ensure_ascii=False)
        done = CallDone(index, name, text)
        events += [CallStart(index, name), ArgumentsDelta(index, text), done]
        self.calls.append(done)


# --- the grammar ----------------------------------------------------------------------------


def harmony_grammar(
    response_format: ResponseFormat | None, tools: ToolSpec | None, call_format: CallFormat
) -> str | None:
    """The grammar of a harmony job (the choices of `grammars.build_grammar`), or None when its
    output is free."""
    ids = dict(call_format.marker_ids)

    def lit(marker: str) -> str:
        return f"<[{ids[marker]}]>" if marker in ids else json.dumps(marker)

    # The first message's header has no `<|start|>assistant` (the prompt ends with it); a
    # message after the thinking block has.
    head = f'({lit(START)} "assistant")? {lit(CHANNEL)}'
    lines = ["%llguidance {}"]
    calls = tools is not None and tools.active
    if response_format is not None:
        schema = _with_options(_format_schema(response_format), response_format.strict)
        lines.append(f'answer: {head} "final" {lit(MESSAGE)} %json {json.dumps(schema)}')
    elif calls:
        lines.append(f'answer: {head} "final" {lit(MESSAGE)} TEXT')
        lines.append("TEXT: /(?s:.*)/")
    else:
        return None
    if tools is None or not calls:
        lines.append("start: answer")
        return _lark("\n".join(lines))
    functions = tools.callable_tools()
    if not functions:
        raise ValueError("no function to call in the harmony format (it has no custom tools)")
    alternatives = []
    assistant = f'({lit(START)} "assistant")?'
    for i, tool in enumerate(functions):
        schema = _with_options(_arguments_schema(tool), tool.strict)
        # The recipient after the channel, as gpt-oss writes a call, or before it, as its chat
        # template writes one.
        after = f"{head} {json.dumps(f'commentary to=functions.{tool.name} ')} {lit(CONSTRAIN)}"
        before = (
            f'{assistant} {json.dumps(f" to=functions.{tool.name}")} {lit(CHANNEL)} "commentary "'
        )
        lines.append(
            f'call_{i}: ({after} | {before}) "json" {lit(MESSAGE)} %json {json.dumps(schema)}'
        )
        alternatives.append(f"call_{i}")
    call = " | ".join(alternatives)
    if tools.choice == "auto" or response_format is not None:
        lines.append(f"start: answer | {call}")
    else:
        lines.append(f"start: {call}")
    return _lark("\n".join(lines))


__all__ = [
    "NAME",
    "HarmonyParser",
    "ReasoningDelta",
    "harmony_format",
    "harmony_grammar",
    "is_harmony",
]
