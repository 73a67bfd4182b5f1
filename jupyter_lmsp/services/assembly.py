"""From the engine's tokens to a task's output pieces: text, function calls, a choice's end.

The worker sends each choice's generated tokens with the text they completed (and their
log-probabilities, when asked for). A thinking model's text first goes through an
`engine.thinking.ThinkingSplitter`: its thinking block becomes `Reasoning` pieces, the rest is
the answer below. For a task without tools that text is its message's. With
tools, it is the model's raw output in its call format, which `engine.toolcalls.
ToolCallParser` (or, for another mlx-lm format, `engine.callformats.FormatParser`: the
`tool_format` the worker reported picks it; for gpt-oss, `engine.harmony.HarmonyParser`, with
or without tools) splits, as it streams, into content and calls
(name, argument or custom input deltas, done);
content before the first call loses its leading whitespace, so a choice that only calls
functions has no message. A call the parser cannot read raises `ToolCallError`: the runner
then fails the task with the reason, never dropping the call.

Parsing is a pure function of the raw text, so a resumed task (its snapshot holds each choice's
raw text) gets its parsers back by feeding them that text again (`restore`), and goes on to
produce exactly the pieces an uninterrupted run would.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from ..engine.callformats import FormatParser, make_parser
from ..engine.grammars import ToolSpec
from ..engine.harmony import HarmonyEvent, HarmonyParser, ReasoningDelta
from ..engine.messages import JobTokens, TokenLogprob
from ..engine.thinking import Thinking, ThinkingSplitter
from ..engine.toolcalls import (
    ArgumentsDelta,
    CallDone,
    CallStart,
    ContentDelta,
    ParserEvent,
    ToolCallError,
    ToolCallParser,
)
from ..protocol.output import (
    Batch,
    CallArguments,
    CallBegin,
    CallEnd,
    ChoiceEnd,
    Piece,
    Reasoning,
    Text,
)
from ..protocol.tools import logprob_entry

__all__ = ["OutputAssembler", "ToolCallError", "wire_logprobs"]


class _Choice:
    def __init__(
        self,
        choice: int,
        parser: ToolCallParser | FormatParser | HarmonyParser | None,
        splitter: ThinkingSplitter | None,
    ) -> None:
        self.choice = choice
        self.parser = parser
        self.splitter = splitter
        # With tools or thinking: whether the message has begun (its first text that is not
        # whitespace).
        self.started = False

    def feed(self, text: str, logprobs: list[dict[str, Any]] | None) -> list[Piece]:
        if self.splitter is not None:
            return self._split(self.splitter.feed(text))
        return self._answer(text, logprobs)

    def _split(self, parts: list[tuple[str, str]]) -> list[Piece]:
        # (A thinking model's job has no log-probabilities: the worker refuses them.)
        pieces: list[Piece] = []
        for kind, part in parts:
            if kind == "reasoning":
                pieces.append(Reasoning(self.choice, part))
            else:
                pieces += self._answer(part, None)
        return pieces

    def _answer(self, text: str, logprobs: list[dict[str, Any]] | None) -> list[Piece]:
        if self.parser is not None:
            return self._pieces(self.parser.feed(text))
        if self.splitter is not None and not self.started:
            # The answer after a thinking block begins at its first text that is not
            # whitespace (a template's blank line after the end marker is not the answer's).
            text = text.lstrip()
            self.started = bool(text)
        return [Text(self.choice, text, logprobs)] if text or logprobs else []

    def end(self, finish_reason: str) -> list[Piece]:
        pieces: list[Piece] = []
        if self.splitter is not None:
            pieces += self._split(self.splitter.finish())
        if self.parser is not None and not (finish_reason == "length" and self.parser.in_call):
            # Cut by the token limit inside a call: that call stays open (`incomplete`).
            pieces += self._pieces(self.parser.finish())
        pieces.append(ChoiceEnd(self.choice, finish_reason))
        return pieces

    def _pieces(self, events: list[ParserEvent] | list[HarmonyEvent]) -> list[Piece]:
        pieces: list[Piece] = []
        for event in events:
            match event:
                case ContentDelta(text=text):
                    if not self.started:
                        text = text.lstrip()
                        self.started = bool(text)
                    if text:
                        pieces.append(Text(self.choice, text))
                case CallStart(index=index, name=name, custom=custom):
                    pieces.append(CallBegin(self.choice, index, name, custom))
                case ArgumentsDelta(index=index, delta=delta):
                    pieces.append(CallArguments(self.choice, index, delta))
                case CallDone(index=index, arguments=arguments):
                    pieces.append(CallEnd(self.choice, index, arguments))
                case ReasoningDelta(text=text):
                    # Thinking later in a harmony output (an analysis message after another).
                    pieces.append(Reasoning(self.choice, text))
        return pieces


class OutputAssembler:
    """One task's output, choice by choice. `tool_format` is the call format the worker
    reported (`JobStarted.tool_format`), None when the model may call nothing."""

    def __init__(
        self,
        tool_format: str | None,
        names: Collection[str] = (),
        n: int = 1,
        customs: Collection[str] = (),
        thinking: Thinking | None = None,
        tools: ToolSpec | None = None,
    ) -> None:
        self.tool_format = tool_format
        self.names = set(names)
        self.customs = set(customs)
        self.thinking = thinking
        # The job's tools: the parsers of some formats type parameter values by their schemas.
        self.tools = tools
        self.choices = [self._new(i) for i in range(max(1, n))]

    def _new(self, choice: int) -> _Choice:
        parser = None
        if self.tool_format is not None:
            parser = make_parser(self.tool_format, self.names or None, self.customs, self.tools)
        splitter = ThinkingSplitter(self.thinking) if self.thinking is not None else None
        return _Choice(choice, parser, splitter)

    def _choice(self, index: int) -> _Choice:
        while len(self.choices) <= index:
            self.choices.append(self._new(len(self.choices)))
        return self.choices[index]

    def restore(self, texts: list[str]) -> None:
        """Feed each choice the raw text its snapshot holds, dropping what it makes (those
        pieces are committed already)."""
        for index, text in enumerate(texts):
            if text:
                self._choice(index).feed(text, None)

    def tokens(self, message: JobTokens) -> Batch:
        """The batch a `JobTokens` makes. Raises `ToolCallError` for a call that cannot be
        read."""
        logprobs = wire_logprobs(message.logprobs) if message.logprobs is not None else None
        pieces = self._choice(message.choice).feed(message.text, logprobs)
        return Batch({message.choice: (list(message.token_ids), message.text)}, pieces)

    def end(self, choice: int, finish_reason: str) -> Batch:
        """The batch that ends a choice. Raises `ToolCallError` if its text ends inside a
        call (other than by the token limit)."""
        return Batch({}, self._choice(choice).end(finish_reason))


def wire_logprobs(entries: list[TokenLogprob]) -> list[dict[str, Any]]:
    """The engine's log-probabilities in the wire shape (`protocol.tools.Logprob`)."""
    return [
        logprob_entry(
            entry.text,
            entry.bytes,
            entry.logprob,
            [(top.text, top.bytes, top.logprob) for top in entry.top],
        )
        for entry in entries
    ]
