"""A "context" MLX model: its greedy output is a given sequence of texts, whatever the prompt,
and a text may repeat (issue 37: kimi_k3 writes `<|open|>`, `<|sep|>` and `<|close|>` several
times in one call).

The chain model (tests/chainmodel.py) picks the next token from the last one alone, so its
texts must differ. This one picks it from the last three: a one-layer llama whose weights are
set by hand (no training), run by mlx-lm and the worker like any model.

- Tokenizer: the test model's byte-level BPE plus each distinct text as one added token (those
  in `special` as special tokens) and `extra_tokens` (the thinking markers by default).
- Embedding: a constant feature, plus one "this token is text u" feature per distinct text u,
  or "this token is none of them" (OTHER). Every token thus has two features set, so the RMS
  norm scales every token alike.
- Attention: two heads, one that attends to the token one back and one to the token two back,
  by position alone. Query and key come from the constant feature, in two rotary pairs of the
  head: RoPE makes their score `A cos(θ (Δ - o))` for a query Δ positions after the key, the
  head's offset o put in the key's phase. The fastest pair (θ = 1 rad a position) makes the
  neighbours of Δ = o lose ≥ 0.46 A_f; it nearly repeats itself from Δ - o = 6 on (cos 6 ≈
  0.96, cos 44 ≈ 0.9998), where the slowest pair takes over: `rope_theta` makes its θ = π /
  WINDOW, so `1 - cos(θ n)` grows over the whole window and A_s is set so that it is ≥ MARGIN
  from n = 6 on. Every other position thus scores ≥ MARGIN (30) below the head's own: the
  softmax puts all but ~e^-30 on it (A_s ≈ 2.8e6: fp32 rounding of the scores, ~1e-7 of that,
  is ~0.3). Each head's value is the token's text features; the output writes them into a
  "one back" (PREV1) or "two back" (PREV2) block of the residual stream, exactly 1 for the
  attended token's text.
- MLP (SwiGLU): a neuron per position i of the script, its gate a sum of the features of the
  shortest context (this token, and as few before it as needed: at most two; before the
  output, the prompt's last token counts as OTHER) that tells position i apart from every
  position whose successor differs, minus (k - 1/2) times the constant for a context of k
  tokens; large when all k match, a large negative (silu ≈ 0) when one does not. Its up projection is the constant, its down projection writes 1 into
  the "next is text i + 1" (or end-of-sequence) feature.
- Output layer: each "next is X" feature scores X (50); the constant scores the first text (5),
  so a prompt whose last token is none of the texts (no neuron fires) leads to the first text.

So the output after the prompt is the texts in order, then end-of-sequence, as long as the
prompt's last token is not one of the texts and prompt plus output stay within `WINDOW`
tokens; a resumed generation (prompt plus the texts written so far) goes on where it was.
`make_context_model` refuses a sequence in which three tokens do not tell a position apart
(`ValueError`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from llamaweights import one_layer_llama

from jupyter_lmsp.models.testmodel import (
    CHAT_TEMPLATE,
    EOS_TOKEN,
    _train_tokenizer,
    token_ids,
    write_model_dir,
)

# The tokens a head looks back to (1 and 2: a context of three tokens with the current one).
OFFSETS = (1, 2)
WINDOW = 4096
MARGIN = 30.0
HEAD_DIM = 64
# The rotary pairs used: the fastest (θ = 1 for any `rope_theta`) and the slowest, whose θ is
# `rope_theta ** -((HEAD_DIM - 2) / HEAD_DIM)`.
SLOW_THETA = math.pi / WINDOW
ROPE_THETA = SLOW_THETA ** (-HEAD_DIM / (HEAD_DIM - 2))
FAST_AMPLITUDE = MARGIN / (1 - math.cos(1.0))
SLOW_AMPLITUDE = MARGIN / (1 - math.cos(6 * SLOW_THETA))
# Gate pre-activation of a neuron whose context matches (minus it when one token misses).
GATE = 16.0
EPS = 1e-5


# In a context: the prompt's last token, which is none of the texts (OTHER).
PROMPT = None


def _contexts(texts: Sequence[str]) -> list[tuple[str | None, ...]]:
    """Per position of `texts`, the shortest context (ending with that position's text; PROMPT
    for the prompt's last token) found at no position whose successor differs."""
    n, longest = len(texts), len(OFFSETS) + 1
    successor = [*texts[1:], None]

    def token(m: int) -> str | None:
        return texts[m] if m >= 0 else PROMPT

    def may_match(j: int, pattern: tuple[str | None, ...]) -> bool:
        # (A token before the prompt's last may be anything.)
        start = j - len(pattern) + 1
        return all(
            m < -1 or token(m) == t for m, t in zip(range(start, j + 1), pattern, strict=True)
        )

    def shortest(i: int) -> tuple[str | None, ...]:
        for k in range(1, min(i + 2, longest) + 1):
            pattern = tuple(token(m) for m in range(i - k + 1, i + 1))
            if not any(may_match(j, pattern) for j in range(n) if successor[j] != successor[i]):
                return pattern
        raise ValueError(
            f"text {i} ({texts[i]!r}): its last {longest} tokens do not tell what follows"
        )

    return [shortest(i) for i in range(n)]


def attention_margin(offset: int, window: int = WINDOW) -> float:
    """How far (float64) the head of `offset` scores every other position below its own, over
    `window` positions."""
    n = np.arange(window + 1, dtype=np.float64) - offset
    n = n[n != 0]
    penalty = FAST_AMPLITUDE * (1 - np.cos(n)) + SLOW_AMPLITUDE * (1 - np.cos(SLOW_THETA * n))
    return float(penalty.min())


def _tokenizer_json(texts: Sequence[str], special: Sequence[str], extra: Sequence[str]) -> str:
    from tokenizers import AddedToken, Tokenizer

    tokenizer = Tokenizer.from_str(_train_tokenizer())
    if special:
        tokenizer.add_special_tokens(
            [AddedToken(t, special=True, normalized=False, single_word=False) for t in special]
        )
    plain = [t for t in dict.fromkeys([*texts, *extra]) if t not in special]
    tokenizer.add_tokens(
        [AddedToken(t, special=False, normalized=False, single_word=False) for t in plain]
    )
    return str(tokenizer.to_str(pretty=True))


def _weights(
    vocab_size: int, ids: dict[str, int], texts: Sequence[str]
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    contexts = _contexts(texts)
    distinct = list(dict.fromkeys(texts))
    slots = len(distinct) + 1  # the texts, and OTHER (EOS in the "next" block)
    other = slots - 1
    slot = {text: u for u, text in enumerate(distinct)}
    heads, d_head = len(OFFSETS), max(HEAD_DIM, slots + slots % 2)
    # (A multiple of the heads, as transformers' config check wants; the rest stay 0.)
    hidden = -(-(1 + (len(OFFSETS) + 2) * slots) // 8) * 8
    CONST = 0

    def block(b: int, u: int) -> int:  # b: 0 this token, 1.. the heads' copies, last "next"
        return 1 + b * slots + u

    next_block = len(OFFSETS) + 1

    embed = np.zeros((vocab_size, hidden), np.float32)
    embed[:, CONST] = 1.0
    embed[:, block(0, other)] = 1.0
    for text, u in slot.items():
        embed[ids[text], block(0, other)] = 0.0
        embed[ids[text], block(0, u)] = 1.0

    # After the input norm each set feature is `c` (two of them in every token).
    c = 1 / math.sqrt(2 / hidden + EPS)
    scale = d_head**-0.5
    half = d_head // 2
    fast = math.sqrt(FAST_AMPLITUDE / scale) / c
    slow = math.sqrt(SLOW_AMPLITUDE / scale) / c
    q = np.zeros((heads * d_head, hidden), np.float32)
    k = np.zeros((heads * d_head, hidden), np.float32)
    v = np.zeros((heads * d_head, hidden), np.float32)
    o = np.zeros((hidden, heads * d_head), np.float32)
    for h, offset in enumerate(OFFSETS):
        base = h * d_head
        # Pair j is dims (j, j + half); pair 0 turns by 1 rad a position, pair half - 1 by
        # SLOW_THETA. The key's phase is the offset's turn.
        for j, theta, amplitude in ((0, 1.0, fast), (half - 1, SLOW_THETA, slow)):
            q[base + j, CONST] = amplitude
            k[base + j, CONST] = amplitude * math.cos(offset * theta)
            k[base + j + half, CONST] = amplitude * math.sin(offset * theta)
        for u in range(slots):
            v[base + u, block(0, u)] = 1.0
            o[block(1 + h, u), base + u] = 1.0 / c

    # After the attention: the constant, this token's text and one per head, each `r` once
    # normed.
    r = 1 / math.sqrt((len(OFFSETS) + 2) / hidden + EPS)
    gate = np.zeros((len(texts), hidden), np.float32)
    up = np.zeros((len(texts), hidden), np.float32)
    down = np.zeros((hidden, len(texts)), np.float32)
    per_match = 2 * GATE / r
    for i, context in enumerate(contexts):
        for back, text in enumerate(reversed(context)):
            gate[i, block(back, other if text is PROMPT else slot[text])] = per_match
        gate[i, CONST] = -(len(context) - 0.5) * per_match
        up[i, CONST] = 1.0 / (GATE * r)
        nxt = slot[texts[i + 1]] if i + 1 < len(texts) else other
        down[block(next_block, nxt), i] = 1.0

    head = np.zeros((vocab_size, hidden), np.float32)
    head[ids[texts[0]], CONST] = 5.0
    for text, u in slot.items():
        head[ids[text], block(next_block, u)] = 50.0
    head[ids[EOS_TOKEN], block(next_block, other)] = 50.0

    weights = one_layer_llama(
        embed, head, intermediate=len(texts), attention=(q, k, v, o), mlp=(gate, up, down)
    )
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": 1,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "head_dim": d_head,
        "intermediate_size": len(texts),
        "rms_norm_eps": EPS,
        "rope_theta": ROPE_THETA,
        "max_position_embeddings": WINDOW,
        "tie_word_embeddings": False,
    }
    return weights, config


def make_context_model(
    path: Path,
    texts: Sequence[str],
    *,
    template: str = CHAT_TEMPLATE,
    special: Sequence[str] = (),
    extra_tokens: Sequence[str] = ("<think>", "</think>"),
) -> Path:
    """Write a model at `path` whose greedy output is `texts` (each one token; `special` among
    them are special tokens), then EOS, and return `path`. `extra_tokens` are added to the
    vocabulary too (the thinking markers by default, so the tokenizer has thinking)."""
    tokenizer_json = _tokenizer_json(texts, special, extra_tokens)
    ids = token_ids(tokenizer_json)
    vocab_size = max(ids.values()) + 1
    weights, config = _weights(vocab_size, ids, texts)
    config = {**config, "vocab_size": vocab_size, "eos_token_id": ids[EOS_TOKEN]}
    return write_model_dir(path, tokenizer_json, config, weights, chat_template=template)
