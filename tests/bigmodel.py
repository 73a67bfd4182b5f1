"""A model big enough for a download to have a middle (issue 39): the test llama with wide MLP
layers, ~32 MB in two safetensors shards (the second ~25 MB), its tokenizer the test model's.
Served by the loopback hub (tests/loopbackhub.py) to test_downloads and the sidebar's
download test."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from jupyter_lmsp.models.testmodel import CONFIG, EOS_TOKEN, write_model_dir

MiB = 1024 * 1024
SHARD1 = "model-00001-of-00002.safetensors"
SHARD2 = "model-00002-of-00002.safetensors"
# huggingface_hub 2.x reads a download's body in 10 MiB pieces and writes each whole: a hub
# that stops sending the second shard a little past one piece has that piece on disk.
GATE = 10 * MiB + 256 * 1024


def write_big_model(folder: Path, test_model_dir: Path) -> Path:
    """Write the model into `folder` (created) and return it."""
    import mlx.core as mx

    from jupyter_lmsp.models.testmodel import _random_weights

    tokenizer_json = (test_model_dir / "tokenizer.json").read_text()
    vocab = json.loads(tokenizer_json)["model"]["vocab"]
    config = {
        **CONFIG,
        "num_hidden_layers": 5,
        "intermediate_size": 8192,
        "vocab_size": len(vocab),
        "eos_token_id": vocab[EOS_TOKEN],
        "bos_token_id": None,
    }
    weights = _random_weights(config, seed=3)
    folder = write_model_dir(folder, tokenizer_json, config, weights)
    (folder / "model.safetensors").unlink()
    first = {k: w for k, w in weights.items() if not k.startswith("model.layers.") or ".0." in k}
    second = {k: w for k, w in weights.items() if k not in first}
    for name, part in ((SHARD1, first), (SHARD2, second)):
        arrays = {k: mx.array(np.asarray(w)) for k, w in part.items()}
        mx.save_safetensors(str(folder / name), arrays, metadata={"format": "mlx"})
    assert (folder / SHARD2).stat().st_size > 2 * GATE
    return folder
