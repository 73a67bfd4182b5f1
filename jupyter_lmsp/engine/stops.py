"""A choice's streamed text: the detokenizer's output, cut at the first stop sequence.

Stop sequences are matched on the decoded text, not on token ids, so a stop string is caught
however the model happened to tokenize it (split over several tokens, or inside a token that
also carries text before or after it). Text is emitted as soon as it cannot be the beginning
of a stop sequence; only the end of the text that could still grow into one is held back. The
stop sequence and everything after it are never emitted.

Resuming: a job resumed from a snapshot (tokens, and the text emitted for them) primes a fresh
`TextStream` with those tokens. The detokenizer's text is a function of the tokens alone, and
what is held back is a function of that text alone (its longest end that begins a stop
sequence), so the primed stream holds back exactly what the uninterrupted one held back at that
point: a snapshot needs to store nothing about stop sequences. The held-back characters are
simply the detokenized text past the snapshot's text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Detokenizer(Protocol):
    """mlx-lm's streaming detokenizer (`TokenizerWrapper.detokenizer`)."""

    def add_token(self, token: int) -> None: ...

    def finalize(self) -> None: ...

    @property
    def text(self) -> str: ...


class StopSequences:
    """Stop strings: where the first one begins in a text, and how much of a text's end could
    still begin one."""

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not stop for stop in stops):
            raise ValueError("a stop sequence must not be empty")
        self.stops = tuple(dict.fromkeys(stops))

    def __bool__(self) -> bool:
        return bool(self.stops)

    def find(self, text: str, start: int = 0) -> int | None:
        """Where the earliest stop sequence begins in `text[start:]` (an index into `text`)."""
        found = [at for stop in self.stops if (at := text.find(stop, start)) >= 0]
        return min(found) if found else None

    def held(self, text: str) -> int:
        """The length of the longest end of `text` that is a proper beginning of a stop."""
        longest = 0
        for stop in self.stops:
            for length in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:length]):
                    longest = length
                    break
        return longest


class TextStream:
    """A choice's text as it streams: a detokenizer primed with the resumed tokens, and the
    stop sequences.

    Text is tracked by length against the detokenizer's (monotonically growing) text; the
    resumed text is a prefix of it (minus what was held back: an incomplete character, a space
    the detokenizer keeps waiting, or the possible start of a stop sequence), so a resumed
    choice emits exactly the text an uninterrupted run would have emitted after it.
    """

    def __init__(
        self,
        detokenizer: Detokenizer,
        stops: StopSequences,
        resumed: Sequence[int] = (),
        resume_text: str = "",
    ) -> None:
        self._detokenizer = detokenizer
        self._stops = stops
        for token in resumed:
            detokenizer.add_token(token)
        self._emitted = len(resume_text)
        self.stopped = False

    def add(self, token: int) -> None:
        self._detokenizer.add_token(token)

    def take(self, final: bool = False) -> str:
        """The text completed since the last call. Sets `stopped` when a stop sequence is
        found (the text returned ends where it begins). `final` flushes everything held back
        (the generation ended), still cut at a stop sequence."""
        if self.stopped:
            return ""
        if final:
            # Flushes bytes held back (an incomplete character at the very end, or a space
            # kept waiting for the next token), as an uninterrupted run does when it ends.
            self._detokenizer.finalize()
        text: str = self._detokenizer.text
        end = len(text)
        if self._stops:
            # A stop cannot begin before the emitted text's end: the longest possible start of
            # one is always held back.
            at = self._stops.find(text, self._emitted)
            if at is not None:
                end = at
                self.stopped = True
            elif not final:
                end -= self._stops.held(text)
        if end <= self._emitted:
            return ""
        chunk = text[self._emitted : end]
        self._emitted = end
        return chunk
