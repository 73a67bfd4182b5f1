"""A thinking test model (issue 37): the tiny random-weight llama of
`jupyter_lmsp.models.testmodel` with `<think>` / `</think>` as special tokens of its tokenizer
and a chat template that honours `enable_thinking`, as Qwen3's does.

`make_thinking_model(dir, opens=True)`: with thinking on, the generation prompt opens the block
(`<|assistant|>\\n<think>\\n`, as R1 distills and Qwen3 thinking models end theirs) when `opens`,
else it leaves the model to open it; with thinking off (`enable_thinking=False`) it holds an
empty, closed block (`<think>\\n\\n</think>\\n\\n`), as Qwen3's template does. mlx-lm infers the
markers from the vocabulary (`TokenizerWrapper.has_thinking`). The weights are random: the
tests check what the engine enforces (budgets, grammars), never what the model would say.
"""

from __future__ import annotations

import json
from pathlib import Path

from jupyter_lmsp.models.testmodel import (
    CONFIG,
    CORPUS,
    EOS_TOKEN,
    SPECIAL_TOKENS,
    VOCAB_SIZE,
    _random_weights,
    write_model_dir,
)

THINK_START, THINK_END = "<think>", "</think>"

_HEAD = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}"
)


def chat_template(opens: bool) -> str:
    on = "<|assistant|>\\n<think>\\n" if opens else "<|assistant|>\\n"
    return (
        _HEAD + "{% if add_generation_prompt %}"
        "{% if enable_thinking is defined and not enable_thinking %}"
        "{{ '<|assistant|>\\n<think>\\n\\n</think>\\n\\n' }}"
        "{% else %}{{ '" + on + "' }}{% endif %}{% endif %}"
    )


def _train_tokenizer() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=1,
        special_tokens=[*SPECIAL_TOKENS, THINK_START, THINK_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    return tokenizer.to_str(pretty=True)


def make_thinking_model(path: Path, *, opens: bool = True, seed: int = 0) -> Path:
    """Write the thinking test model at `path` (created if missing) and return `path`."""
    tokenizer_json = _train_tokenizer()
    vocab = json.loads(tokenizer_json)["model"]["vocab"]
    config = {
        **CONFIG,
        "vocab_size": len(vocab),
        "eos_token_id": vocab[EOS_TOKEN],
        "bos_token_id": None,
    }
    return write_model_dir(
        path,
        tokenizer_json,
        config,
        _random_weights(config, seed),
        chat_template=chat_template(opens),
    )
