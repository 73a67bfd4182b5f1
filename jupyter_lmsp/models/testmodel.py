"""The tiny random-weight test model: a 2-layer llama with a byte-level BPE tokenizer.

`make_test_model(dir)` writes an MLX model directory that `mlx_lm.load` opens in a few
hundredths of a second. The weights are meaningless, but generation runs through the real
mlx-lm code path (prefill, KV cache, sampling, streaming detokenizer), which is what the engine
tests need. Everything is derived from the seed, so the same seed gives byte-identical files.

Command line: `python -m jupyter_lmsp.models.testmodel DIR [--seed N]`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

EOS_TOKEN = "<|end|>"
SPECIAL_TOKENS = [EOS_TOKEN, "<|system|>", "<|user|>", "<|assistant|>"]
VOCAB_SIZE = 500

CONFIG = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
    # Untied: with tied random embeddings the model mostly echoes its last input token.
    "tie_word_embeddings": False,
}

# Chat template in the same shape as real instruct models: one block per message, then an
# assistant header when a reply is wanted.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

# Training text for the tokenizer. Non-ASCII words are here so that multi-byte characters get
# merged tokens of their own *and* can still be produced byte by byte, which exercises the
# streaming detokenizer's handling of partial UTF-8 characters.
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A language model predicts the next token from the tokens before it.",
    "Jupyter notebooks mix code, text and results in one document.",
    "The capital of France is Paris, and the capital of Italy is Rome.",
    "Please summarise the following paragraph in one sentence.",
    "What is the weather like today in the mountains?",
    "It is sunny in the morning and cloudy in the afternoon.",
    "Python is a programming language that lets you work quickly.",
    "The server streams events to every client that is watching.",
    "A task can be cancelled, resumed after a crash, or left to finish.",
    "Tokens are committed to the database before they reach a watcher.",
    "The café on the corner serves crème brûlée and naïve smoothies.",
    "Zoë and Chloé met in Zürich, then flew to São Paulo.",
    "Temperatures reached 30°C — hotter than last year’s record.",
    "Emoji like 🙂 and 🚀 take four bytes in UTF-8.",
    "Greek letters: α, β, γ, δ; and the Japanese word 日本語.",
    "Once upon a time there was a small robot who loved to read.",
    "The robot read every book in the library, one page at a time.",
    "Numbers such as 42, 3.14 and 1000 appear in many texts.",
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i)\n",
    "She sells sea shells by the sea shore.",
    "How much wood would a woodchuck chuck if a woodchuck could chuck wood?",
    "The answer is yes, but only on Tuesdays and Thursdays.",
    "Write a short poem about the ocean and the stars.",
    "The ocean is deep and blue; the stars are bright and far away.",
    "Thank you for your question. Here is a detailed answer.",
    "First, open the file. Second, read the lines. Third, close it.",
    "An apple a day keeps the doctor away.",
    "Knowledge is power, and practice makes perfect.",
    "The meeting starts at nine o'clock in the main hall.",
    "Remember to save your work before closing the notebook.",
    "Hello! How can I help you today?",
    "I am a helpful assistant running on your own computer.",
    "Summary: the experiment worked and the results were good.",
    "Error: the file could not be found. Please try again.",
]


def _train_tokenizer() -> str:
    """Train the byte-level BPE tokenizer and return its tokenizer.json text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    return tokenizer.to_str(pretty=True)


def _random_weights(config: dict, seed: int) -> dict[str, np.ndarray]:
    """Random llama weights in the Hugging Face layout, scaled so activations stay O(1)."""
    rng = np.random.default_rng(seed)
    d = config["hidden_size"]
    heads = config["num_attention_heads"]
    kv_heads = config["num_key_value_heads"]
    head_dim = d // heads
    ff = config["intermediate_size"]
    vocab = config["vocab_size"]

    def linear(out_dim: int, in_dim: int) -> np.ndarray:
        return (rng.standard_normal((out_dim, in_dim)) / np.sqrt(in_dim)).astype(np.float32)

    embed = rng.standard_normal((vocab, d))
    # A purely random output layer sends greedy decoding into a loop of one or two tokens
    # within a few dozen steps. Instead the output row of token `perm[i]` is (a noisy copy of)
    # the embedding of token i, so the most likely next token is a fixed random permutation
    # of the current one, perturbed by attention over the context: long, varied output that
    # sometimes reaches EOS by itself.
    perm = rng.permutation(vocab)
    head = np.empty_like(embed)
    head[perm] = embed
    head += 0.5 * rng.standard_normal(head.shape)
    weights: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": embed.astype(np.float32),
        "model.norm.weight": np.ones(d, np.float32),
        "lm_head.weight": (head / np.sqrt(d)).astype(np.float32),
    }
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = np.ones(d, np.float32)
        weights[p + "post_attention_layernorm.weight"] = np.ones(d, np.float32)
        weights[p + "self_attn.q_proj.weight"] = linear(heads * head_dim, d)
        weights[p + "self_attn.k_proj.weight"] = linear(kv_heads * head_dim, d)
        weights[p + "self_attn.v_proj.weight"] = linear(kv_heads * head_dim, d)
        weights[p + "self_attn.o_proj.weight"] = linear(d, heads * head_dim)
        weights[p + "mlp.gate_proj.weight"] = linear(ff, d)
        weights[p + "mlp.up_proj.weight"] = linear(ff, d)
        weights[p + "mlp.down_proj.weight"] = linear(d, ff)
    return weights


def token_ids(tokenizer_json: str) -> dict[str, int]:
    """Every token of a `tokenizer.json` by its text: the BPE vocabulary and the added
    tokens."""
    data = json.loads(tokenizer_json)
    ids: dict[str, int] = dict(data["model"]["vocab"])
    ids.update({t["content"]: t["id"] for t in data.get("added_tokens") or []})
    return ids


def write_model_dir(
    path: Path,
    tokenizer_json: str,
    config: dict[str, Any],
    weights: dict[str, np.ndarray],
    *,
    chat_template: str = CHAT_TEMPLATE,
) -> Path:
    """Write an MLX model directory (tokenizer, its config with EOS and chat template, model
    config, safetensors weights) at `path` (created if missing) and return `path`. The test
    models here and the hand-set ones of the tests share it."""
    import mlx.core as mx

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    # Without tokenizer_config.json mlx-lm loads the tokenizer with no EOS token, so generation
    # would never stop by itself.
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "bos_token": None,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
        "chat_template": chat_template,
    }
    (path / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n", encoding="utf-8"
    )
    (path / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN}, indent=2) + "\n",
        encoding="utf-8",
    )
    (path / "config.json").write_text(
        json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8"
    )
    arrays = {name: mx.array(w) for name, w in weights.items()}
    mx.save_safetensors(str(path / "model.safetensors"), arrays, metadata={"format": "mlx"})
    return path


def make_test_model(path: Path, seed: int = 0) -> Path:
    """Write the test model directory at `path` (created if missing) and return `path`."""
    tokenizer_json = _train_tokenizer()
    vocab = json.loads(tokenizer_json)["model"]["vocab"]
    config = {
        **CONFIG,
        "vocab_size": len(vocab),
        "eos_token_id": vocab[EOS_TOKEN],
        "bos_token_id": None,
    }
    return write_model_dir(path, tokenizer_json, config, _random_weights(config, seed))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write the tiny random-weight test model.")
    parser.add_argument("dir", type=Path, help="output directory (created if missing)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(make_test_model(args.dir, seed=args.seed))


if __name__ == "__main__":
    main()
