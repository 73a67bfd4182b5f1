"""A reasoning model's thinking block: recognised as mlx-lm recognises it (issue 37).

mlx-lm's `TokenizerWrapper` infers a model's thinking markers from its vocabulary (`<think>` /
`</think>` and the other single-token pairs, or multi-token ones such as Gemma's
`<|channel>thought` … `<channel|>`); `Thinking.of` takes them from there (and, for gpt-oss, whose
thinking mlx-lm does not infer, its analysis channel: `engine.harmony`), and whether the
prompt already opened the block (R1 distills' and Qwen3's templates end the generation prompt
with the start marker): as mlx_lm.server decides, the last start marker of the prompt comes
after its last end marker.

Pure (no MLX): the worker reports a job's `Thinking` when it starts, counts each choice's
reasoning tokens with a `ReasoningCounter`, and the server splits each choice's text into
reasoning and answer with a `ThinkingSplitter`. Only a block at the start of the output is
thinking (leading whitespace allowed); a marker written later is answer text. Both are pure
functions of what they are fed, so a resumed job that feeds them its committed tokens and text
again goes on exactly as an uninterrupted one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# gpt-oss's harmony markers (`engine.harmony`): a tokenizer with each as a token is a harmony
# one, and its analysis channel is its thinking block.
HARMONY_MARKERS = (
    "<|start|>",
    "<|channel|>",
    "<|message|>",
    "<|end|>",
    "<|call|>",
    "<|return|>",
    "<|constrain|>",
)
HARMONY_THINKING = ("<|channel|>analysis<|message|>", "<|end|>")


@dataclass(frozen=True)
class Thinking:
    """A model's thinking markers (their text and token ids) and whether the prompt opened
    the block, so the output begins inside it."""

    start: str
    end: str
    start_ids: tuple[int, ...]
    end_ids: tuple[int, ...]
    open: bool = False

    @classmethod
    def of(cls, tokenizer: Any, prompt_ids: Sequence[int]) -> Thinking | None:
        """The thinking of a model (mlx-lm's `TokenizerWrapper`) for a prompt; None for a model
        without thinking markers."""
        if getattr(tokenizer, "has_thinking", False):
            start, end = tokenizer.think_start, tokenizer.think_end
            start_ids = tuple(tokenizer.think_start_tokens or ())
            end_ids = tuple(tokenizer.think_end_tokens or ())
        else:
            from .harmony import is_harmony

            if not is_harmony(tokenizer):
                return None
            start, end = HARMONY_THINKING
            start_ids = tuple(tokenizer.encode(start, add_special_tokens=False))
            end_ids = tuple(tokenizer.encode(end, add_special_tokens=False))
        if not start_ids or not end_ids:
            return None
        opened = _rfind(prompt_ids, start_ids) > _rfind(prompt_ids, end_ids)
        return cls(start, end, start_ids, end_ids, opened)


def _rfind(ids: Sequence[int], marker: tuple[int, ...]) -> int:
    """Where `marker` last occurs in `ids` (-1 if it does not)."""
    n = len(marker)
    for at in range(len(ids) - n, -1, -1):
        if tuple(ids[at : at + n]) == marker:
            return at
    return -1


_BEFORE, _IN, _AFTER = "before", "in", "after"


class ReasoningCounter:
    """Counts one choice's reasoning tokens as they are generated: those of its thinking block,
    markers included."""

    def __init__(self, thinking: Thinking) -> None:
        self._thinking = thinking
        self._state = _IN if thinking.open else _BEFORE
        self._pending: list[int] = []
        self._tail: list[int] = []
        self.count = 0

    def feed(self, token_ids: Sequence[int]) -> None:
        for token in token_ids:
            self._one(token)

    def _one(self, token: int) -> None:
        start, end = self._thinking.start_ids, self._thinking.end_ids
        if self._state == _BEFORE:
            self._pending.append(token)
            if tuple(self._pending) == start:
                self._state, self.count = _IN, len(self._pending)
                self._pending = []
            elif tuple(self._pending) != start[: len(self._pending)]:
                self._state, self._pending = _AFTER, []
        elif self._state == _IN:
            self.count += 1
            self._tail = [*self._tail, token][-len(end) :]
            if tuple(self._tail) == end:
                self._state = _AFTER


class ThinkingSplitter:
    """Splits one choice's text, as it streams, into reasoning (the thinking block, markers
    left out) and answer. Text that may still turn out to be a marker is held back."""

    def __init__(self, thinking: Thinking) -> None:
        self._start, self._end = thinking.start, thinking.end
        self._state = _IN if thinking.open else _BEFORE
        self._buffer = ""

    @property
    def reasoning(self) -> bool:
        """Whether the text so far ends inside the thinking block."""
        return self._state == _IN

    def feed(self, text: str) -> list[tuple[str, str]]:
        """The (kind, text) pieces `text` completes, kind "reasoning" or "answer"."""
        self._buffer += text
        out: list[tuple[str, str]] = []
        while self._buffer:
            if self._state == _BEFORE:
                body = self._buffer.lstrip()
                if body.startswith(self._start):
                    self._state = _IN
                    self._buffer = body[len(self._start) :]
                elif self._start.startswith(body):
                    return out  # whitespace, or the start marker's beginning: wait
                else:
                    self._state = _AFTER
            elif self._state == _IN:
                at = self._buffer.find(self._end)
                if at < 0:
                    keep = _partial_suffix(self._buffer, self._end)
                    _put(out, "reasoning", self._buffer[: len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    return out
                _put(out, "reasoning", self._buffer[:at])
                self._buffer = self._buffer[at + len(self._end) :]
                self._state = _AFTER
            else:
                _put(out, "answer", self._buffer)
                self._buffer = ""
        return out

    def finish(self) -> list[tuple[str, str]]:
        """The end of the text: what was held back goes out as what it is."""
        out: list[tuple[str, str]] = []
        _put(out, "reasoning" if self._state == _IN else "answer", self._buffer)
        self._buffer = ""
        return out


def _put(out: list[tuple[str, str]], kind: str, text: str) -> None:
    if text:
        out.append((kind, text))


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper beginning of `marker`."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0
