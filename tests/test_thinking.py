"""Thinking blocks (issue 37): markers and the open block as mlx-lm infers them, the reasoning
token count, and the split of a choice's text into reasoning and answer, whatever the chunking
(a resumed choice re-feeds its committed text and must get the same pieces)."""

from __future__ import annotations

import random

import pytest

from jupyter_lmsp.engine.thinking import ReasoningCounter, Thinking, ThinkingSplitter

THINK = Thinking("<think>", "</think>", (7,), (8,))
MULTI = Thinking("<|channel>thought", "<channel|>", (3, 4), (5, 6))


def split(thinking: Thinking, text: str, seed: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    splitter = ThinkingSplitter(thinking)
    pieces: list[tuple[str, str]] = []
    at = 0
    while at < len(text):
        step = rng.randint(1, 5)
        pieces += splitter.feed(text[at : at + step])
        at += step
    pieces += splitter.finish()
    joined: dict[str, str] = {}
    order: list[str] = []
    for kind, part in pieces:
        if kind not in joined:
            order.append(kind)
        joined[kind] = joined.get(kind, "") + part
    return [(kind, joined[kind]) for kind in order]


@pytest.mark.parametrize("seed", range(15))
def test_a_leading_block_is_reasoning_and_the_rest_answer(seed):
    text = "\n<think>First, 2 < 3.\nSo </thin k> no.</think>\n\nThe answer is 5. <think>x</think>"
    assert split(THINK, text, seed) == [
        ("reasoning", "First, 2 < 3.\nSo </thin k> no."),
        ("answer", "\n\nThe answer is 5. <think>x</think>"),
    ]


@pytest.mark.parametrize("seed", range(5))
def test_an_opened_block_and_multi_token_markers(seed):
    opened = Thinking("<think>", "</think>", (7,), (8,), open=True)
    assert split(opened, "hmm</think>Yes.", seed) == [("reasoning", "hmm"), ("answer", "Yes.")]
    assert split(MULTI, "<|channel>thoughtplan<channel|>Done", seed) == [
        ("reasoning", "plan"),
        ("answer", "Done"),
    ]
    # No block: all answer; cut inside a block: all reasoning so far.
    assert split(THINK, "Plain <think>", seed) == [("answer", "Plain <think>")]
    assert split(THINK, "<think>still thinking", seed) == [("reasoning", "still thinking")]


def test_reasoning_tokens_are_the_blocks_markers_included():
    counter = ReasoningCounter(THINK)
    counter.feed([7, 1, 2])
    counter.feed([3, 8, 4, 7, 8])
    assert counter.count == 5
    opened = ReasoningCounter(Thinking("<think>", "</think>", (7,), (8,), open=True))
    opened.feed([1, 8, 2])
    assert opened.count == 2
    multi = ReasoningCounter(MULTI)
    multi.feed([3, 4, 9, 5])
    multi.feed([6, 1])
    assert multi.count == 5
    none = ReasoningCounter(THINK)
    none.feed([1, 7, 8])
    assert none.count == 0


def test_markers_and_the_open_block_come_from_mlx_lm(tokenizer):
    class Wrapper:
        has_thinking = True
        think_start, think_end = "<think>", "</think>"
        think_start_tokens, think_end_tokens = (7,), (8,)

    assert Thinking.of(Wrapper(), [1, 7, 2, 8, 3]).open is False
    assert Thinking.of(Wrapper(), [1, 7, 2, 8, 3, 7]).open is True
    # The test model's tokenizer has no thinking markers.
    assert Thinking.of(tokenizer, [1, 2]) is None
