"""A "chain" MLX model: its greedy output is a given sequence of texts, whatever the prompt.

For the thinking tests (issue 37) a model must write, say, `<think>`, some thinking,
`</think>` and an answer, through the real mlx-lm code path and the engine. This model is built
by hand (no training): a one-layer llama whose attention and MLP are zero, so the last token
alone decides the next, a bigram table:

- the tokenizer is the test model's byte-level BPE plus each text of the chain as one added
  token (the thinking markers among them, so mlx-lm finds `<think>`/`</think>` in the
  vocabulary and the tokenizer "has thinking", as Qwen3's does);
- the embedding has a constant feature, and one feature per chain text;
- the output layer scores the first text from the constant (any token that is not part of the
  chain, such as the end of the prompt, leads to it), each text's successor from that text's
  feature (far stronger), and end-of-sequence after the last.

The chain's texts must differ (a bigram table cannot repeat one). `make_chain_model(dir,
texts, template=...)` writes the model; the default chat template is the test model's, and
`THINKING_TEMPLATE` opens the thinking block in the generation prompt unless
`enable_thinking` is false, as Qwen3's and R1 distills' templates do, and shows an earlier
assistant turn's `reasoning_content` in a block before its answer.
"""

from __future__ import annotations

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

HIDDEN = 32
CONST = 0

# The test model's template, with the thinking block opened after the assistant header unless
# the caller turns thinking off.
THINKING_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' }}"
    "{% if message['role'] == 'assistant' and message.get('reasoning_content') %}"
    "{{ '<think>\\n' + message['reasoning_content'] + '</think>\\n' }}{% endif %}"
    "{{ message['content'] + '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}"
    "{% if enable_thinking is not defined or enable_thinking %}{{ '<think>\\n' }}{% endif %}"
    "{% endif %}"
)

CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": HIDDEN,
    "num_hidden_layers": 1,
    "num_attention_heads": 1,
    "num_key_value_heads": 1,
    "head_dim": HIDDEN,
    "intermediate_size": 16,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}


def _tokenizer_json(texts: Sequence[str], extra: Sequence[str]) -> str:
    from tokenizers import AddedToken, Tokenizer

    tokenizer = Tokenizer.from_str(_train_tokenizer())
    tokenizer.add_tokens(
        [
            AddedToken(text, special=False, normalized=False, single_word=False)
            for text in [*texts, *(t for t in extra if t not in texts)]
        ]
    )
    return str(tokenizer.to_str(pretty=True))


def _weights(vocab_size: int, ids: dict[str, int], texts: Sequence[str]) -> dict[str, np.ndarray]:
    d = HIDDEN
    if len(texts) + 1 > d:
        raise ValueError(f"at most {d - 1} texts in a chain")
    embed = np.zeros((vocab_size, d), np.float32)
    embed[:, CONST] = 1.0
    head = np.zeros((vocab_size, d), np.float32)
    head[ids[texts[0]], CONST] = 5.0
    for i, text in enumerate(texts, start=1):
        embed[ids[text], i] = 1.0
        successor = ids[texts[i]] if i < len(texts) else ids[EOS_TOKEN]
        head[successor, i] = 50.0
    return one_layer_llama(embed, head, intermediate=CONFIG["intermediate_size"])


def make_chain_model(
    path: Path,
    texts: Sequence[str],
    *,
    template: str = CHAT_TEMPLATE,
    extra_tokens: Sequence[str] = ("<think>", "</think>"),
) -> Path:
    """Write a model at `path` whose greedy output is `texts` (each one token), then EOS.
    `extra_tokens` are added to the vocabulary too (the thinking markers by default, so the
    tokenizer has thinking even when the chain does not write them)."""
    if len(set(texts)) != len(texts):
        raise ValueError("a chain's texts must differ")
    tokenizer_json = _tokenizer_json(texts, extra_tokens)
    ids = token_ids(tokenizer_json)
    vocab_size = max(ids.values()) + 1
    config = {**CONFIG, "vocab_size": vocab_size, "eos_token_id": ids[EOS_TOKEN]}
    weights = _weights(vocab_size, ids, texts)
    return write_model_dir(path, tokenizer_json, config, weights, chat_template=template)
