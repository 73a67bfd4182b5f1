"""Stop strings matched incrementally (issue 43): `engine.stops` against the matcher it
replaced, written out here as the reference (every stop searched in the text from the emitted
end, and every proper beginning of every stop compared with the text's end).

- Any texts, stops and ways of splitting the text into steps (hypothesis), with detokenizers
  that revise the end of their text as mlx-lm's naive one does: the same chunks, the same stop,
  from a fresh stream and from one primed as a resumed job's is.
- The work per step is the new text: with four stops of 1,024 characters (the cap) and 20,000
  one-character steps, each character is read once (the reference compared up to 4 x 1,023
  beginnings per step).
"""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from jupyter_lmsp.engine.stops import StopSequences, TextStream


def ref_find(stops: Sequence[str], text: str, start: int) -> int | None:
    found = [at for stop in stops if (at := text.find(stop, start)) >= 0]
    return min(found) if found else None


def ref_held(stops: Sequence[str], text: str) -> int:
    longest = 0
    for stop in stops:
        for length in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:length]):
                longest = length
                break
    return longest


class Steps:
    """A detokenizer over given texts: token i makes the text `texts[i]` (each extends the
    emitted part of the one before; its end may differ, as a re-decoded tail does)."""

    def __init__(self, texts: Sequence[str]) -> None:
        self.texts = texts
        self.n = 0
        self.final = ""

    def add_token(self, token: int) -> None:
        self.n = token + 1

    def finalize(self) -> None:
        self.final = "!"  # a flushed byte

    @property
    def text(self) -> str:
        return (self.texts[self.n - 1] if self.n else "") + self.final


def reference(stops: Sequence[str], texts: Sequence[str]) -> tuple[list[str], bool]:
    emitted, chunks = 0, []
    for i, text in enumerate([*texts, texts[-1] + "!"]):
        final = i == len(texts)
        end = len(text)
        at = ref_find(stops, text, emitted)
        if at is not None:
            end = at
        elif not final:
            # Held: the end of the text not emitted yet that could begin a stop. (A stop
            # beginning in emitted text is never looked for, `ref_find` from `emitted`: after a
            # revision of held-back text the whole text's end may begin one there.)
            end -= ref_held(stops, text[emitted:])
        chunks.append(text[emitted:end] if end > emitted else "")
        emitted = max(emitted, end)
        if at is not None:
            return chunks, True
    return chunks, False


def streamed(stops: StopSequences, texts: Sequence[str]) -> tuple[list[str], bool]:
    stream = TextStream(Steps(texts), stops)
    chunks = []
    for i in range(len(texts)):
        stream.add(i)
        chunks.append(stream.take())
        if stream.stopped:
            return chunks, True
    chunks.append(stream.take(final=True))
    return chunks, stream.stopped


ALPHABET = "ab\nxé"
stops_st = st.lists(st.text(ALPHABET, min_size=1, max_size=6), min_size=1, max_size=4)


@st.composite
def growing_texts(draw: st.DrawFn) -> list[str]:
    """Texts a detokenizer shows step by step: each adds text, and sometimes rewrites the
    last few characters of the one before (never more than it added since)."""
    texts: list[str] = []
    text = ""
    for _ in range(draw(st.integers(1, 12))):
        added = draw(st.text(ALPHABET, max_size=5))
        revise = draw(st.integers(0, 2)) if texts else 0
        if revise and len(text) >= revise:
            text = text[:-revise] + draw(st.text(ALPHABET, min_size=revise, max_size=revise))
        text += added
        texts.append(text)
    return texts


@settings(max_examples=400, deadline=None)
@given(stops=stops_st, texts=growing_texts())
def test_the_same_chunks_and_stop_as_the_reference(stops: list[str], texts: list[str]) -> None:
    matcher = StopSequences(stops)
    for text in texts:
        for start in range(len(text) + 1):
            assert matcher.find(text, start) == ref_find(matcher.stops, text, start)
        assert matcher.held(text) == ref_held(matcher.stops, text)
    if all(texts[i + 1].startswith(t) for i, t in enumerate(texts[:-1])):
        # Revisions aside (the reference takes every text as it is; a revision of text
        # already emitted is the detokenizer's business), the chunks are the reference's.
        assert streamed(matcher, texts) == reference(matcher.stops, texts)


@settings(max_examples=300, deadline=None)
@given(stops=stops_st, texts=growing_texts(), cut=st.integers(0, 11))
def test_revised_and_resumed_streams_match_the_reference(
    stops: list[str], texts: list[str], cut: int
) -> None:
    """With revisions, the stream's chunks are those of the reference applied to each text as
    it is; a stream primed with the first `cut` tokens and the text emitted for them goes on
    as the uninterrupted one."""
    matcher = StopSequences(stops)
    chunks, stopped = streamed(matcher, texts)
    want, want_stopped = reference(matcher.stops, texts)
    emitted_by_ref = "".join(want)
    # A revision may touch only held-back text when the reference emitted nothing revised.
    if all(t.startswith(emitted_by_ref[: len("".join(want[:i]))]) for i, t in enumerate(texts)):
        assert (chunks, stopped) == (want, want_stopped)
    cut = min(cut, len(texts) - 1)
    if cut == 0 or (stopped and len(chunks) <= cut):
        return
    primed = TextStream(Steps(texts), matcher, range(cut), "".join(chunks[:cut]))
    rest = []
    for i in range(cut, len(texts)):
        primed.add(i)
        rest.append(primed.take())
        if primed.stopped:
            break
    else:
        rest.append(primed.take(final=True))
    assert (chunks[:cut] + rest, primed.stopped) == (chunks, stopped)


def test_each_character_is_read_once_with_long_stops() -> None:
    stops = ["ab" * 511 + "c!", "a" * 1023 + "d", "x" * 1023 + "y", "b" * 1024]
    text = ("ab" * 600 + "a" * 1100 + "x" * 1100) * 4
    stream = TextStream(Steps([text[: i + 1] for i in range(len(text))]), StopSequences(stops))
    out = []
    for i in range(len(text)):
        stream.add(i)
        out.append(stream.take())
    out.append(stream.take(final=True))
    assert "".join(out) == text + "!" and not stream.stopped
    assert stream.scanned == len(text) + 1
    # And a stop that completes after thousands of steps is cut where it begins.
    hit = text + "x" * 1023 + "y" + "tail"
    stream = TextStream(Steps([hit[: i + 1] for i in range(len(hit))]), StopSequences(stops))
    out = []
    for i in range(len(hit)):
        stream.add(i)
        out.append(stream.take())
        if stream.stopped:
            break
    assert stream.stopped and "".join(out) == text and stream.scanned <= len(hit)
