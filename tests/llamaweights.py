"""The weights of a one-layer llama, by name, for the hand-set test models (tests/chainmodel.py,
tests/scriptedmodel.py, tests/contextmodel.py): the models set the embedding, output layer,
attention and MLP; the norms are ones. An attention or MLP left out is zero (it adds nothing
to the residual stream)."""

from __future__ import annotations

import numpy as np


def one_layer_llama(
    embed: np.ndarray,
    head: np.ndarray,
    *,
    intermediate: int,
    attention: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None,
    mlp: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """`attention` is (q, k, v, o) and `mlp` (gate, up, down), as mlx-lm's llama names them."""
    d = embed.shape[1]
    if attention is None:
        zero = np.zeros((d, d), np.float32)
        attention = (zero, zero, zero, zero)
    if mlp is None:
        mlp = (
            np.zeros((intermediate, d), np.float32),
            np.zeros((intermediate, d), np.float32),
            np.zeros((d, intermediate), np.float32),
        )
    q, k, v, o = attention
    gate, up, down = mlp
    p = "model.layers.0."
    return {
        "model.embed_tokens.weight": embed,
        "model.norm.weight": np.ones(d, np.float32),
        "lm_head.weight": head,
        p + "input_layernorm.weight": np.ones(d, np.float32),
        p + "post_attention_layernorm.weight": np.ones(d, np.float32),
        p + "self_attn.q_proj.weight": q,
        p + "self_attn.k_proj.weight": k,
        p + "self_attn.v_proj.weight": v,
        p + "self_attn.o_proj.weight": o,
        p + "mlp.gate_proj.weight": gate,
        p + "mlp.up_proj.weight": up,
        p + "mlp.down_proj.weight": down,
    }
