"""The context model (tests/contextmodel.py) in mlx-lm alone: greedy decoding writes its texts,
repeats and all, then end-of-sequence, whatever the prompt (short, long, full of its own texts),
alone or batched, and a generation resumed from part of its output goes on where it was."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from contextmodel import OFFSETS, WINDOW, attention_margin, make_context_model
from familymodels import chat_template, family_script

# kimi_k3's call after a thinking block: `<|open|>` four times, `<|sep|>` seven.
SCRIPT = family_script("kimi_k3")
TEXTS = ("<think>", "I should", " run it", "</think>", *SCRIPT.tokens)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    from mlx_lm import load

    path = make_context_model(
        tmp_path_factory.mktemp("context") / "model",
        TEXTS,
        special=("<think>", "</think>", *SCRIPT.special),
        template=chat_template("kimi_k3"),
    )
    model, tokenizer = load(str(path))[:2]
    return model, tokenizer


def _greedy(model: Any, tokenizer: Any, prompt: list[int]) -> list[int]:
    """The tokens greedy decoding writes before end-of-sequence (none after 40 tokens)."""
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    out, sampler = [], make_sampler(0.0)
    for step in stream_generate(model, tokenizer, prompt, max_tokens=40, sampler=sampler):
        if step.finish_reason == "stop":
            return out
        out.append(step.token)
    return []


def test_the_heads_single_out_their_offset_over_the_window() -> None:
    for offset in OFFSETS:
        assert attention_margin(offset) >= 30


def test_greedy_decoding_writes_the_texts_whatever_the_prompt(loaded: tuple[Any, Any]) -> None:
    model, tokenizer = loaded
    want = [tokenizer.convert_tokens_to_ids(text) for text in TEXTS]
    other = tokenizer.encode("b", add_special_tokens=False)
    rng = random.Random(0)
    vocab = len(tokenizer.get_vocab())
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True
        )
        for content in ("Run it.", "x", "Hello there " * 300)
    ]
    prompts += [other, other * 2, other * 3]
    # Random tokens, the model's texts among them, up to the window (less the output).
    prompts += [[rng.randrange(vocab) for _ in range(n)] + other for n in (50, WINDOW - 60)]
    for prompt in prompts:
        assert _greedy(model, tokenizer, prompt) == want, len(prompt)


def test_batched_and_resumed(loaded: tuple[Any, Any]) -> None:
    from mlx_lm import batch_generate
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = loaded
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True)
        for c in ("Run it.", "Hello " * 200, "a")
    ]
    batched = batch_generate(model, tokenizer, prompts, max_tokens=40, sampler=make_sampler(0.0))
    assert batched.texts == ["".join(TEXTS)] * 3
    # Cut after each of the output's tokens (inside repeats too): the rest follows.
    ids = [tokenizer.convert_tokens_to_ids(text) for text in TEXTS]
    for cut in range(1, len(TEXTS)):
        assert _greedy(model, tokenizer, prompts[0] + ids[:cut]) == ids[cut:], cut


def test_the_first_text_may_repeat(tmp_path: Path) -> None:
    """Told apart by the prompt's last token (none of the texts): XTML's thinking block
    (`<|open|>think<|sep|>` … `<|close|>think<|sep|>`) before kimi_k3's call."""
    from mlx_lm import load

    texts = ("<|open|>", "think", "<|sep|>", "I should", "<|close|>", "think", "<|sep|>")
    texts += SCRIPT.tokens
    path = make_context_model(tmp_path / "m", texts, special=SCRIPT.special, extra_tokens=())
    model, tokenizer = load(str(path))[:2]
    want = [tokenizer.convert_tokens_to_ids(text) for text in texts]
    for content in ("Run it.", "Hello " * 100):
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True
        )
        assert _greedy(model, tokenizer, prompt) == want


def test_a_sequence_three_tokens_cannot_tell_apart_is_refused(tmp_path: Path) -> None:
    # `b c d` is followed by `e` once and `f` once.
    with pytest.raises(ValueError, match="do not tell"):
        make_context_model(tmp_path / "m", ("a", "b", "c", "d", "e", "b", "c", "d", "f"))
    # The first `b` (then `b`) and the second (then `c`) after the same two tokens.
    with pytest.raises(ValueError, match="do not tell"):
        make_context_model(tmp_path / "n", ("a", "b", "a", "b", "b", "a", "b", "c"))
