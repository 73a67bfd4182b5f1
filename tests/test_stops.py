"""Stop sequences, matched on the decoded text (`engine.stops`), through the scheduler with the
test model and through the worker process.

Stop strings are picked from the test model's own greedy output, so each case is known to
occur where it is meant to: straddling a token boundary, inside the first token, never. The
expected text is the uninterrupted run's text cut where the stop string begins.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from schedrun import job, run_one, streamed_text
from test_engine import new_id, start_engine

from jupyter_lmsp.engine.messages import GenerateJob, JobFinished, JobTokens
from jupyter_lmsp.engine.stops import StopSequences

pytestmark = pytest.mark.timeout(120)

MAX_TOKENS = 48


@pytest.fixture(scope="module")
def full(tiny: tuple[Any, Any]) -> Any:
    """The uninterrupted greedy run, without stop sequences."""
    model, tok = tiny
    result = run_one(model, tok, job("full", max_tokens=MAX_TOKENS))
    assert result.finish_reason == "length" and len(result.tokens) == MAX_TOKENS
    return result


def boundaries(tok: Any, tokens: list[int]) -> list[int]:
    """The streamed text's length after each token (where one token's text ends and the next
    begins; half a character shows only once the next token completes it)."""
    return [len(streamed_text(tok, tokens[: i + 1])) for i in range(len(tokens))]


def test_stop_sequences_find_and_hold() -> None:
    stops = StopSequences(["END", "xyz", "END"])
    assert stops.stops == ("END", "xyz")
    assert stops.find("abc END xyz") == 4
    assert stops.find("abc END xyz", 5) == 8
    assert stops.find("abc") is None
    assert stops.held("abc EN") == 2
    assert stops.held("abc xy") == 2
    assert stops.held("abc E") == 1
    assert stops.held("abc END") == 0  # complete: found, not held
    assert stops.held("abc") == 0
    with pytest.raises(ValueError):
        StopSequences([""])


def check_stopped(tiny: tuple[Any, Any], full: Any, stop: list[str], **sampling: Any) -> Any:
    """A run with `stop`: the text is the full run's, cut where the first stop begins; the
    tokens stop at the one that completed it; nothing held back was ever emitted early."""
    model, tok = tiny
    result = run_one(model, tok, job(new_id("stop"), max_tokens=MAX_TOKENS, stop=stop, **sampling))
    full_text = streamed_text(tok, full.tokens, final=True)
    cut = min(i for s in stop if (i := full_text.find(s)) >= 0)
    assert result.finish_reason == "stop"
    assert result.text == full_text[:cut]
    assert not any(s in result.text for s in stop)
    ends = boundaries(tok, full.tokens)
    # The token that completed the stop string (in the streamed text) is the last one output.
    completing = next(i for i, end in enumerate(ends) if any(s in full_text[:end] for s in stop))
    assert result.tokens == full.tokens[: completing + 1]
    # Along the way, exactly the possible beginnings of a stop were held back.
    stops = StopSequences(stop)
    emitted = ""
    for i, update in enumerate(result.updates[:-1]):
        emitted += update.text
        so_far = streamed_text(tok, full.tokens[: i + 1])
        assert emitted == so_far[: len(so_far) - stops.held(so_far)], i
    return result


def test_stop_straddling_token_boundaries(tiny, full) -> None:
    _model, tok = tiny
    text = streamed_text(tok, full.tokens, final=True)
    ends = boundaries(tok, full.tokens)
    # A 4-character string across the boundary after some later token, whose text occurs
    # only from there on (and holds no U+FFFD, which only stands for broken bytes).
    for end in ends[5:-5]:
        stop = text[end - 2 : end + 2]
        if len(stop) == 4 and text.find(stop) == end - 2 and "\ufffd" not in stop:
            break
    else:
        pytest.fail("no boundary to straddle")
    result = check_stopped(tiny, full, [stop])
    assert result.text == text[: end - 2]
    # Two stop sequences: the earlier one wins, whichever is listed first.
    later = text[ends[-3] : ends[-3] + 3]
    assert check_stopped(tiny, full, [later, stop]).text == text[: end - 2]


def test_stop_inside_the_first_token(tiny) -> None:
    model, tok = tiny
    # A seed whose first token is whole text (the greedy one is half a character).
    for seed in range(50):
        sampling = {"temperature": 1.0, "seed": seed}
        first = run_one(model, tok, job(new_id("first"), max_tokens=1, **sampling))
        piece = streamed_text(tok, first.tokens)
        if len(piece.strip()) >= 2 and "\ufffd" not in piece:
            break
    else:
        pytest.fail("no seed starts with a whole word")
    full = run_one(model, tok, job(new_id("full"), max_tokens=MAX_TOKENS, **sampling))
    assert full.tokens[0] == first.tokens[0]
    model_and_tok = (model, tok)
    # The stop is the end of the first token's text: the text before it, then nothing.
    stop = piece.strip()[-2:]
    result = check_stopped(model_and_tok, full, [stop], **sampling)
    assert result.tokens == full.tokens[:1]
    assert result.text == piece[: piece.find(stop)]
    # The whole first token: no text at all.
    result = check_stopped(model_and_tok, full, [piece], **sampling)
    assert result.tokens == full.tokens[:1] and result.text == ""


def test_stop_that_never_appears(tiny, full) -> None:
    model, tok = tiny
    result = run_one(model, tok, job("never", max_tokens=MAX_TOKENS, stop=["\x00never", "ZZZZ"]))
    assert result.finish_reason == "length"
    assert result.tokens == full.tokens
    assert result.text == streamed_text(tok, full.tokens, final=True)


def test_a_stop_completed_by_the_final_flush_is_still_cut(tiny, full) -> None:
    """max_tokens ends the run while text is held back: what completes a stop there is cut."""
    model, tok = tiny
    text = streamed_text(tok, full.tokens, final=True)
    stop = text[-2:] + "\x00"  # its beginning ends the text, it never completes
    result = run_one(model, tok, job("flush", max_tokens=MAX_TOKENS, stop=[stop]))
    assert result.finish_reason == "length" and result.text == text
    assert result.updates[-1].text.endswith(text[-2:])  # held back until the end


@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.0, "top_p": 0.9, "seed": 7}])
def test_resumed_stop_runs_equal_the_uninterrupted_one(tiny, sampling: dict) -> None:
    """Resumed at every step from the snapshot the runner would hold (the tokens and the text
    emitted so far), a job gives exactly the uninterrupted text, tokens and finish reason."""
    model, tok = tiny
    plain = run_one(model, tok, job("plain", max_tokens=MAX_TOKENS, **sampling))
    text = streamed_text(tok, plain.tokens, final=True)
    ends = boundaries(tok, plain.tokens)
    end = ends[len(ends) // 2]
    stop = [text[end - 3 : end + 1], "\x00unused"]
    full = run_one(model, tok, job("uninterrupted", max_tokens=MAX_TOKENS, stop=stop, **sampling))
    assert full.finish_reason == "stop" and len(full.tokens) > 10
    held_at = []
    for k in range(1, len(full.tokens) + 1):
        snapshot_tokens = [t for u in full.updates[:k] for t in u.token_ids]
        snapshot_text = "".join(u.text for u in full.updates[:k])
        if len(snapshot_text) < len(streamed_text(tok, snapshot_tokens)):
            held_at.append(k)
        resumed = run_one(
            model,
            tok,
            job(
                new_id("resumed"),
                max_tokens=MAX_TOKENS,
                stop=stop,
                resume_token_ids=snapshot_tokens,
                resume_text=snapshot_text,
                **sampling,
            ),
        )
        assert snapshot_tokens + resumed.tokens == full.tokens, k
        assert snapshot_text + resumed.text == full.text, k
        assert resumed.finish_reason == "stop", k
    # The interesting case happened: snapshots taken while text was held back.
    assert held_at


def test_stop_sequences_through_the_worker(test_model_dir: Path, tokenizer) -> None:
    eng = start_engine(test_model_dir)
    try:
        full = eng.run(new_id("plain"), max_tokens=MAX_TOKENS)
        text = full.text
        stop = text[len(text) // 2 : len(text) // 2 + 3]
        run = eng.run(new_id("stopped"), max_tokens=MAX_TOKENS, stop=[stop, "\x00"])
        assert isinstance(run.end, JobFinished) and run.end.finish_reason == "stop"
        assert run.text == text[: text.find(stop)]
        assert all(stop not in chunk.text for chunk in run.chunks)
        assert run.end.output_tokens == len(run.tokens) < MAX_TOKENS
        assert all(isinstance(c, JobTokens) and c.choice == 0 for c in run.chunks)
        bad = eng.run(new_id("bad"), stop=["a", "b", "c", "d", "e"])
        assert bad.end.code == "invalid_request"  # type: ignore[attr-defined]
        empty = eng.run(new_id("empty"), stop=[""])
        assert empty.end.code == "invalid_request"  # type: ignore[attr-defined]
    finally:
        eng.client.stop()


def test_job_messages_default_to_one_choice() -> None:
    j = GenerateJob("j", "", [], max_tokens=3, resume_token_ids=[1, 2], resume_text="x", n=2)
    points = j.resume_points()
    assert [p.token_ids for p in points] == [[1, 2], []]
    assert [p.text for p in points] == ["x", ""]
