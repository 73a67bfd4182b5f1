"""Log-probabilities of generated tokens (`engine.logprobs`), against a direct computation.

The reference runs the test model once over the prompt and the generated tokens (no KV cache,
no batch) and derives each step's distribution by hand: log-softmax; for sampling, divided by
the temperature, cut to the top_p nucleus (numpy, written here independently of
`mlx_lm.sample_utils`) and normalized again; for greedy, the log-softmax itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from schedrun import CHAT, job, run, run_one
from test_engine import new_id, start_engine

from jupyter_lmsp.engine.grammars import ResponseFormat, build_grammar
from jupyter_lmsp.engine.messages import JobFinished
from jupyter_lmsp.engine.worker import encode_chat

pytestmark = pytest.mark.timeout(120)


def reference(model: Any, tok: Any, tokens: list[int], temperature: float, top_p: float) -> Any:
    """Each generated token's step distribution (log-probabilities, one row per token)."""
    import mlx.core as mx

    prompt = encode_chat(tok, CHAT)
    logits = model(mx.array(prompt + tokens[:-1])[None])[0, len(prompt) - 1 :]
    logits = np.array(logits.astype(mx.float32), dtype=np.float64)
    rows = []
    for row in logits:
        lp = row - np.logaddexp.reduce(row)
        if temperature > 0:
            lp = lp / temperature
            lp = lp - np.logaddexp.reduce(lp)
            if top_p < 1:
                order = np.argsort(-lp)
                probs = np.exp(lp[order])
                above = np.cumsum(probs) - probs  # mass of the tokens more likely than each
                keep = order[above < top_p]
                cut = np.full_like(lp, -np.inf)
                cut[keep] = lp[keep]
                lp = cut - np.logaddexp.reduce(cut[keep])
        rows.append(lp)
    return rows


@pytest.mark.parametrize(
    "sampling",
    [{}, {"temperature": 0.7, "top_p": 0.9, "seed": 3}, {"temperature": 1.3, "seed": 11}],
    ids=["greedy", "top_p", "hot"],
)
def test_logprobs_match_a_direct_computation(tiny, sampling: dict) -> None:
    model, tok = tiny
    top = 5
    result = run_one(
        model, tok, job("lp", max_tokens=24, logprobs=True, top_logprobs=top, **sampling)
    )
    assert len(result.logprobs) == len(result.tokens) == 24
    rows = reference(
        model, tok, result.tokens, sampling.get("temperature", 0.0), sampling.get("top_p", 1.0)
    )
    for i, (entry, token, row) in enumerate(zip(result.logprobs, result.tokens, rows, strict=True)):
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(row[token], abs=2e-3), i
        finite = np.isfinite(row)
        assert len(entry.top) == min(top, int(finite.sum()))
        values = [alt.logprob for alt in entry.top]
        assert values == sorted(values, reverse=True)
        expected = np.sort(row[finite])[::-1][: len(entry.top)]
        assert np.allclose(values, expected, atol=2e-3), i
        for alt in entry.top:
            assert alt.logprob == pytest.approx(row[alt.token_id], abs=2e-3)
        if not sampling:
            # Greedy: the token chosen is the most likely one.
            assert entry.logprob == pytest.approx(values[0], abs=1e-5)
        assert entry.text == bytes(entry.bytes).decode("utf-8", errors="replace")
    # The tokens' bytes, end to end, are the text.
    data = b"".join(bytes(entry.bytes) for entry in result.logprobs)
    assert data.decode("utf-8", errors="replace") == result.text


def test_a_nucleus_smaller_than_top_lists_fewer(tiny) -> None:
    model, tok = tiny
    result = run_one(
        model,
        tok,
        job("narrow", max_tokens=12, logprobs=True, top_logprobs=20, temperature=0.3, top_p=0.2),
    )
    assert any(len(entry.top) < 20 for entry in result.logprobs)
    for entry in result.logprobs:
        assert entry.top and all(np.isfinite(alt.logprob) for alt in entry.top)
        assert entry.token_id in [alt.token_id for alt in entry.top]


def test_constrained_logprobs_are_those_of_the_masked_distribution(tiny) -> None:
    import llguidance

    from jupyter_lmsp.engine.constraints import ll_tokenizer

    model, tok = tiny
    fmt = ResponseFormat(
        "json_schema",
        {
            "type": "object",
            "properties": {"k": {"enum": ["aa", "bb"]}},
            "required": ["k"],
            "additionalProperties": False,
        },
        strict=True,
    )
    grammar = build_grammar(fmt, None)
    assert grammar is not None
    result = run(
        model, tok, [job("masked", max_tokens=120, logprobs=True, top_logprobs=20)], grammar
    )[("masked", 0)]
    assert result.finish_reason == "stop"
    matcher = llguidance.LLMatcher(ll_tokenizer("m", model, tok), grammar, log_level=0)
    for entry in result.logprobs:
        # Every listed alternative is a token the grammar allowed at that step.
        for alt in entry.top:
            assert matcher.validate_tokens([alt.token_id]) == 1, alt
        # The probabilities left are the allowed tokens': they add up to (at most) one.
        assert sum(np.exp(alt.logprob) for alt in entry.top) <= 1.0 + 1e-4
        assert matcher.consume_token(entry.token_id)


def test_logprobs_through_the_worker(test_model_dir: Path) -> None:
    eng = start_engine(test_model_dir)
    try:
        run_ = eng.run(new_id("lp"), max_tokens=20, logprobs=True, top_logprobs=3)
        assert isinstance(run_.end, JobFinished)
        for chunk in run_.chunks:
            assert chunk.logprobs is not None
            assert [entry.token_id for entry in chunk.logprobs] == chunk.token_ids
            assert all(len(entry.top) == 3 for entry in chunk.logprobs)
        plain = eng.run(new_id("plain"), max_tokens=20)
        assert plain.tokens == run_.tokens and plain.text == run_.text
        assert all(chunk.logprobs is None for chunk in plain.chunks)
        for bad in ({"top_logprobs": 21, "logprobs": True}, {"top_logprobs": 2}):
            failed = eng.run(new_id("bad"), **bad)
            assert failed.end.code == "invalid_request"  # type: ignore[attr-defined]
    finally:
        eng.client.stop()
