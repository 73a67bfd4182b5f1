"""A "scripted" MLX model for the real-client tests: its greedy output is fixed by construction.

The tests that drive a real agent (tests/test_codex_cli.py runs the Codex CLI) need a model that
calls a tool on the first turn and answers in text once the tool's result is in its prompt, with
the client's own request (its tools, `tool_choice: auto`): no grammar can force that. The random
test model (`jupyter_lmsp.models.testmodel`) never would, and a real model is too big and not
reliable enough. So this model is built by hand: a one-layer llama whose weights are set, not
trained, so that greedy decoding produces exactly

- `CALL_TEXT` then end-of-sequence when the prompt holds no `<tool_response>` (turn 1), and
- `ANSWER_TEXT` then end-of-sequence once it does (the generic call format renders a tool's
  result as a `<tool_response>` block: `jupyter_lmsp.engine.toolcalls`).

How: the tokenizer is the test model's byte-level BPE plus three added tokens, `CALL_TEXT`,
`ANSWER_TEXT` and `<tool_response>`, each one token (added tokens are matched in the raw text,
so the rendered prompt of turn 2 holds the `<tool_response>` token). The embedding has three
features: a constant, "this token is `<tool_response>`" and "this token is a scripted output".
The attention head's query is the constant and its key the `<tool_response>` feature, large, in
the head dimensions RoPE leaves (almost) unrotated (a huge `rope_theta`), so the head attends to
the `<tool_response>` tokens when there are any and spreads evenly over the context (adding
nothing) when there are none; it writes "a result was seen" into a fourth feature. The MLP is
zero. The output layer then scores `CALL_TEXT` from the constant, minus "a result was seen";
`ANSWER_TEXT` from "a result was seen"; end-of-sequence from "this token is a scripted output",
strongest of all. Every other token scores 0. It runs through the real mlx-lm code path and the
engine like any model; only its behaviour is fixed.

The first turn's output may also be a sequence of tokens (`script`: a family's call written
with its special tokens, tests/familymodels.py): each scripted token then has a feature of its
own ("this is script token i") from which the output layer scores token i + 1, the last one
scoring end-of-sequence; the chat template and the tokenizer's extra special tokens are then the
family's.

Command line: `python tests/scriptedmodel.py DIR` (writes the model, prints DIR).
"""

from __future__ import annotations

import json
import sys
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

# The command the scripted call runs, and the call in the generic format (one `exec_command`
# call, Codex CLI's shell tool: `cmd` is the command line). The newline the grammar allows after
# the calls ends it: llguidance takes an added token that starts with `<` and ends with `>` for
# a special token, which text can never match (the `auto` grammar would then mask it out).
COMMAND = "echo scripted-hi"
CALL_NAME = "exec_command"
CALL_ARGUMENTS = {"cmd": COMMAND}
CALL_TEXT = (
    "<tool_call>\n"
    + json.dumps({"name": CALL_NAME, "arguments": CALL_ARGUMENTS})
    + "\n</tool_call>\n"
)
ANSWER_TEXT = "The command ran and printed scripted-hi."
RESULT_MARKER = "<tool_response>"

HIDDEN = 16
# The features (residual stream dimensions); a script's token i has feature NEXT + i.
CONST, IS_RESULT, IS_SCRIPTED, SAW_RESULT, NEXT = 0, 1, 2, 3, 4
# The head dimensions holding the query and key: RoPE's slowest-rotating pair (dims `HALF - 1`
# and `HIDDEN - 1` of the one head), with `ROPE_THETA` making its rotation negligible even at
# the end of the window.
HALF = HIDDEN // 2
QK_DIM = HALF - 1
ROPE_THETA = 1e12
WINDOW = 131072

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
    "rope_theta": ROPE_THETA,
    "max_position_embeddings": WINDOW,
    "tie_word_embeddings": False,
}


def _tokenizer_json(script: tuple[str, ...] = (CALL_TEXT,), special: tuple[str, ...] = ()) -> str:
    """The test model's tokenizer with the scripted outputs and the result marker added
    (`special` as special tokens)."""
    from tokenizers import AddedToken, Tokenizer

    tokenizer = Tokenizer.from_str(_train_tokenizer())
    if special:
        tokenizer.add_special_tokens(
            [
                AddedToken(text, special=True, normalized=False, single_word=False)
                for text in special
            ]
        )
    plain = [t for t in (*script, ANSWER_TEXT, RESULT_MARKER) if t not in special]
    tokenizer.add_tokens(
        [
            AddedToken(text, special=False, normalized=False, single_word=False)
            for text in dict.fromkeys(plain)
        ]
    )
    return str(tokenizer.to_str(pretty=True))


def _weights(
    vocab_size: int, ids: dict[str, int], script: tuple[str, ...] = (CALL_TEXT,)
) -> dict[str, np.ndarray]:
    if len(set(script)) != len(script) or len(script) > HIDDEN - NEXT + 1:
        raise ValueError("a script is at most 13 distinct tokens")
    d = HIDDEN
    embed = np.zeros((vocab_size, d), np.float32)
    embed[:, CONST] = 1.0
    embed[ids[RESULT_MARKER], IS_RESULT] = 1.0
    embed[ids[script[-1]], IS_SCRIPTED] = 1.0
    embed[ids[ANSWER_TEXT], IS_SCRIPTED] = 1.0
    for i, token in enumerate(script[:-1]):
        embed[ids[token], NEXT + i] = 1.0

    # After the RMS norm the constant is 2..4 and a set feature ~2.3..2.8: a score of ~70 on a
    # `<tool_response>` key (scale 1/4), far above log(WINDOW), against 0 on every other key.
    q = np.zeros((d, d), np.float32)
    q[QK_DIM, CONST] = 5.0
    k = np.zeros((d, d), np.float32)
    k[QK_DIM, IS_RESULT] = 5.0
    v = np.zeros((d, d), np.float32)
    v[0, IS_RESULT] = 1.0
    # The head's value is ~2.8 on a `<tool_response>` token: "a result was seen" becomes ~1,
    # the size of the constant.
    o = np.zeros((d, d), np.float32)
    o[SAW_RESULT, 0] = 1.0 / 2.83

    head = np.zeros((vocab_size, d), np.float32)
    head[ids[script[0]], CONST] = 10.0
    head[ids[script[0]], SAW_RESULT] = -20.0
    for i, token in enumerate(script[1:]):
        head[ids[token], NEXT + i] = 40.0
    head[ids[ANSWER_TEXT], SAW_RESULT] = 20.0
    head[ids[EOS_TOKEN], IS_SCRIPTED] = 40.0

    return one_layer_llama(
        embed, head, intermediate=CONFIG["intermediate_size"], attention=(q, k, v, o)
    )


def make_scripted_model(
    path: Path,
    *,
    script: tuple[str, ...] = (CALL_TEXT,),
    special: tuple[str, ...] = (),
    chat_template: str = CHAT_TEMPLATE,
) -> Path:
    """Write the scripted model's directory at `path` (created if missing) and return it.
    `script`: the first turn's tokens (each one token of the tokenizer; `special` are added as
    special tokens), `chat_template` the template its tokenizer config holds."""
    tokenizer_json = _tokenizer_json(script, special)
    ids = token_ids(tokenizer_json)
    vocab_size = max(ids.values()) + 1
    config = {
        **CONFIG,
        "vocab_size": vocab_size,
        "eos_token_id": ids[EOS_TOKEN],
        "bos_token_id": None,
    }
    weights = _weights(vocab_size, ids, script)
    return write_model_dir(path, tokenizer_json, config, weights, chat_template=chat_template)


if __name__ == "__main__":
    print(make_scripted_model(Path(sys.argv[1])))
