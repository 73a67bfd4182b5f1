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

Matching is incremental (issue 43): the stop strings are compiled once per job into an
Aho-Corasick automaton, and each choice's stream keeps its state, so each step feeds the
automaton only the characters decoded since the last one. The held-back end of the text is
exactly the string of the automaton's state (at most the longest stop string less one
character), and is compared with the detokenizer's text each step (a C string comparison): a
detokenizer that revised it (mlx-lm's naive detokenizer re-decodes its unflushed tokens) makes
the stream rescan from the end of the emitted text, which is what a stop can begin after.
Per step that is linear in the new text, where matching the whole held-back end against every
prefix of every stop string was quadratic in the stop strings' length.
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
    """Stop strings, compiled into an Aho-Corasick automaton: where the first one begins in a
    text, and how much of a text's end could still begin one.

    A state is a node: the longest end of the text read so far that begins some stop string.
    Node 0 is the empty string."""

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not stop for stop in stops):
            raise ValueError("a stop sequence must not be empty")
        self.stops = tuple(dict.fromkeys(stops))
        self._goto: list[dict[str, int]] = [{}]
        self._depth = [0]
        for stop in self.stops:
            node = 0
            for ch in stop:
                nxt = self._goto[node].get(ch)
                if nxt is None:
                    nxt = len(self._goto)
                    self._goto[node][ch] = nxt
                    self._goto.append({})
                    self._depth.append(self._depth[node] + 1)
                node = nxt
        self._longest = max(self._depth)
        complete = set()
        for stop in self.stops:
            node = 0
            for ch in stop:
                node = self._goto[node][ch]
            complete.add(node)
        # Breadth first: a node's failure link (its longest proper end that is also a node) is
        # known before its children's, as is the longest stop string it ends with.
        self._fail = [0] * len(self._goto)
        self._ends = [0] * len(self._goto)  # the longest stop string the node's string ends with
        order = list(self._goto[0].values())
        for node in order:
            if node in complete:
                self._ends[node] = self._depth[node]
        for node in order:
            if not self._ends[node] and self._fail[node]:
                self._ends[node] = self._ends[self._fail[node]]
            for ch, child in self._goto[node].items():
                self._fail[child] = self.step(self._fail[node], ch) if node else 0
                if child in complete:
                    self._ends[child] = self._depth[child]
                order.append(child)

    def __bool__(self) -> bool:
        return bool(self.stops)

    def step(self, node: int, ch: str) -> int:
        """The state after reading `ch` in state `node`."""
        goto = self._goto
        while True:
            nxt = goto[node].get(ch)
            if nxt is not None:
                return nxt
            if node == 0:
                return 0
            node = self._fail[node]

    def scan(self, node: int, text: str, start: int) -> tuple[int | None, int]:
        """Reads `text[start:]` from state `node`: where the earliest stop string that ends in
        it begins (None: none does), and the state after it (once a stop is found, the state
        where reading stopped: no stop ending later can begin earlier)."""
        found: int | None = None
        longest = self._longest
        for i in range(start, len(text)):
            if found is not None and i + 1 - longest >= found:
                break  # a stop ending here or later cannot begin before the one found
            node = self.step(node, text[i])
            length = self._ends[node]
            if length:
                begins = i + 1 - length
                found = begins if found is None else min(found, begins)
        return found, node

    def depth(self, node: int) -> int:
        """The length of a state's string."""
        return self._depth[node]

    def find(self, text: str, start: int = 0) -> int | None:
        """Where the earliest stop sequence begins in `text[start:]` (an index into `text`)."""
        return self.scan(0, text, start)[0]

    def held(self, text: str) -> int:
        """The length of the longest end of `text` that is a proper beginning of a stop."""
        node = 0
        for ch in text:
            node = self.step(node, ch)
        # The node's string, or its longest end that is a node, with a stop continuing it.
        while node and not self._goto[node]:
            node = self._fail[node]
        return self._depth[node]


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
        # The automaton's state, and the text it read since its last reset (at `_window_at`)
        # that can still begin a stop: the state's string.
        self._node = 0
        self._window_at = self._emitted
        self._window = ""
        self.scanned = 0  # characters fed to the automaton (each once, unless text was revised)

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
            # one is always held back, and is the automaton's window.
            if self._window_at < self._emitted or not text.startswith(
                self._window, self._window_at
            ):  # the held-back text was revised: read again from the emitted text's end
                self._node, self._window_at, self._window = 0, self._emitted, ""
            start = self._window_at + len(self._window)
            at, self._node = self._stops.scan(self._node, text, start)
            self.scanned += max(0, len(text) - start)
            if at is not None:
                end = at
                self.stopped = True
            else:
                held = self._stops.depth(self._node)
                self._window_at = len(text) - held
                self._window = text[self._window_at :]
                if not final:
                    end -= held
        if end <= self._emitted:
            return ""
        chunk = text[self._emitted : end]
        self._emitted = end
        return chunk
