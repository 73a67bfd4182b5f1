"""GGUF → MLX conversion: turn a llama-architecture GGUF file into a model directory `mlx_lm` loads.

`mx.load(path, return_metadata=True)` reads GGUF natively: quantized tensors come back as MLX
affine triples (`weight` packed in uint32, `scales`, `biases`, group size 32) and the metadata
holds the llama hyper-parameters, the byte-level BPE vocabulary and the chat template. This module
renames the tensors to the Hugging Face llama layout, writes `config.json`, rebuilds
`tokenizer.json` with the `tokenizers` package and writes `tokenizer_config.json` (without it
`mlx_lm` finds no EOS token and generation never stops).

The directory is built beside `out_dir` and renamed into place, so `out_dir` is either absent,
the previous complete version, or the new complete version — never a partial one.
"""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
import shutil
import struct
import sys
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

ProgressCallback = Callable[[str, float], None]

#: Files every converted model directory holds.
WEIGHTS_FILE = "model.safetensors"
CONVERSION_FILE = "conversion.json"
REQUIRED_FILES = (
    "config.json",
    WEIGHTS_FILE,
    "tokenizer.json",
    "tokenizer_config.json",
    CONVERSION_FILE,
)

# mx.load unpacks every GGUF quantization it supports (Q4_0, Q4_1, Q8_0) with this group size.
GROUP_SIZE = 32
_SUPPORTED_BITS = (4, 8)

# GGUF token types (llama.cpp's llama_token_type).
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

_TOP_LEVEL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TENSOR_RE = re.compile(
    r"^(?:blk\.(?P<layer>\d+)\.)?(?P<name>\w+)\.(?P<part>weight|scales|biases|bias)$"
)

# llama.cpp's pre-tokenizer families whose regex is "split every digit, then GPT-2's regex".
_DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva"}
_GPT2_PRE = {"default", "gpt2", "gpt-2"}

# How far through the whole conversion each stage starts, so one bar can show the fraction.
_STAGE_START = {"reading": 0.0, "weights": 0.05, "tokenizer": 0.6, "writing": 0.65, "done": 1.0}


class GGUFConversionError(ValueError):
    """The GGUF file describes a model this converter cannot represent faithfully."""


def default_dequantize() -> bool:
    """Whether to store float32 weights by default on this platform.

    MLX's quantized CPU kernels do not use BLAS and stay slow on Linux, while float32 matmuls go
    through (Open)BLAS; on Apple silicon the quantized form is the fast one.
    """
    return sys.platform != "darwin"


def is_converted_model(model_dir: Path) -> bool:
    """True when `model_dir` holds every file a finished conversion writes."""
    return all((Path(model_dir) / name).is_file() for name in REQUIRED_FILES)


def convert_gguf(
    gguf_path: Path,
    out_dir: Path,
    *,
    dequantize: bool | None = None,
    progress: ProgressCallback | None = None,
    replace: bool = True,
    marker: tuple[str, Mapping[str, Any]] | None = None,
) -> Path:
    """Convert a llama GGUF file into an MLX model directory at `out_dir` and return it.

    `dequantize=None` picks the platform default (`default_dequantize()`): float32 on Linux,
    the GGUF's own 4/8-bit quantization on macOS. `progress(stage, fraction)` is called with
    stages "reading", "weights", "tokenizer", "writing", "done"; `fraction` is of the whole
    conversion and never decreases. An exception raised by `progress` aborts the conversion
    and, unless raised at "done", leaves `out_dir` as it was. An existing `out_dir` is replaced,
    unless `replace` is False: then an existing `out_dir` (other than an empty folder) is left
    alone and `FileExistsError` raised. `marker` (file name, JSON value) is written into the
    directory with the rest, so it is there from the moment the directory is.
    """
    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    if dequantize is None:
        dequantize = default_dequantize()
    report = _Reporter(progress)

    report("reading", 0.0)
    # With return_metadata, mx.load answers (tensors, metadata); its stub says any load result.
    tensors, metadata = cast(
        tuple[dict[str, mx.array], dict[str, Any]],
        mx.load(str(gguf_path), return_metadata=True),
    )
    architecture = _text(metadata, "general.architecture")
    if architecture != "llama":
        raise GGUFConversionError(f"{gguf_path.name}: architecture {architecture!r} is not llama")

    weights, module_bits = _convert_tensors(tensors, dequantize=dequantize, report=report)
    del tensors
    config = _model_config(metadata, weights, module_bits)

    report("tokenizer", 0.0)
    tokenizer, tokenizer_config = _build_tokenizer(metadata)
    if tokenizer.get_vocab_size(with_added_tokens=True) > config["vocab_size"]:
        raise GGUFConversionError(
            f"{gguf_path.name}: {tokenizer.get_vocab_size()} tokens but an embedding of "
            f"{config['vocab_size']} rows"
        )
    report("tokenizer", 1.0)

    provenance = {
        "converter": "jupyter_lmsp.models.gguf",
        "format_version": 1,
        "source": gguf_path.name,
        "source_size": gguf_path.stat().st_size,
        "dequantized": dequantize,
    }

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # mkdir (not mkdtemp, which makes it 0700) so the model directory gets the usual umask mode.
    staging = _sibling(out_dir, "partial")
    staging.mkdir()
    try:
        report("writing", 0.0)
        mx.save_safetensors(str(staging / WEIGHTS_FILE), weights, metadata={"format": "mlx"})
        del weights
        report("writing", 0.8)
        tokenizer.save(str(staging / "tokenizer.json"))
        _write_json(staging / "tokenizer_config.json", tokenizer_config)
        _write_json(staging / "config.json", config)
        if marker is not None:
            _write_json(staging / marker[0], marker[1])
        # Written last: its presence is what marks a directory as a finished conversion.
        _write_json(staging / CONVERSION_FILE, provenance)
        _fsync_tree(staging)
        report("writing", 1.0)
        if replace:
            _replace_dir(staging, out_dir)
        else:
            _place_dir(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    report("done", 1.0)
    return out_dir


class _Reporter:
    """Turns (stage, fraction of stage) into (stage, fraction of the whole conversion)."""

    def __init__(self, callback: ProgressCallback | None) -> None:
        self._callback = callback
        self._stages = list(_STAGE_START)

    def __call__(self, stage: str, stage_fraction: float) -> None:
        if self._callback is None:
            return
        start = _STAGE_START[stage]
        index = self._stages.index(stage)
        end = _STAGE_START[self._stages[index + 1]] if index + 1 < len(self._stages) else 1.0
        self._callback(stage, start + (end - start) * min(max(stage_fraction, 0.0), 1.0))


def _convert_tensors(
    tensors: Mapping[str, mx.array], *, dequantize: bool, report: _Reporter
) -> tuple[dict[str, mx.array], dict[str, int]]:
    """Rename GGUF tensors to Hugging Face llama names; dequantize or keep the triples.

    Returns the weights and, for modules left quantized, their bit width.
    """
    modules: dict[str, dict[str, mx.array]] = {}
    for gguf_name, array in tensors.items():
        match = _TENSOR_RE.match(gguf_name)
        if match is None:
            raise GGUFConversionError(f"unsupported tensor {gguf_name!r}")
        layer, name, part = match.group("layer", "name", "part")
        if layer is None:
            base = _TOP_LEVEL_NAMES.get(name)
        else:
            suffix = _BLOCK_NAMES.get(name)
            base = None if suffix is None else f"model.layers.{layer}.{suffix}"
        if base is None:
            # e.g. llama 3.1's rope_freqs: silently dropping it would give a subtly wrong model.
            raise GGUFConversionError(f"unsupported tensor {gguf_name!r}")
        modules.setdefault(base, {})[part] = array

    weights: dict[str, mx.array] = {}
    module_bits: dict[str, int] = {}
    for done, (base, parts) in enumerate(sorted(modules.items()), start=1):
        if "scales" in parts:
            weight, scales, biases = parts["weight"], parts["scales"], parts["biases"]
            # Packed uint32 columns hold 32/bits values each; scales hold one value per group.
            bits = weight.shape[-1] * 32 // (scales.shape[-1] * GROUP_SIZE)
            if bits not in _SUPPORTED_BITS:
                raise GGUFConversionError(f"{base}: unsupported {bits}-bit quantization")
            if dequantize:
                full = mx.dequantize(weight, scales, biases, group_size=GROUP_SIZE, bits=bits)
                weights[f"{base}.weight"] = full.astype(mx.float32)
            else:
                weights[f"{base}.weight"] = weight
                weights[f"{base}.scales"] = scales
                weights[f"{base}.biases"] = biases
                module_bits[base] = bits
        else:
            for part, array in parts.items():
                key = f"{base}.{part}"
                weights[key] = array.astype(mx.float32) if dequantize else array
        # Evaluate module by module so progress means something and peak memory stays low.
        mx.eval([weights[key] for key in weights if key.startswith(f"{base}.")])
        report("weights", done / len(modules))
    return weights, module_bits


def _model_config(
    metadata: Mapping[str, Any], weights: Mapping[str, mx.array], module_bits: Mapping[str, int]
) -> dict[str, Any]:
    """The `config.json` for mlx_lm's llama model, from the GGUF hyper-parameters."""
    hidden = _int(metadata, "llama.embedding_length")
    heads = _int(metadata, "llama.attention.head_count")
    head_dim = _int(metadata, "llama.attention.key_length", hidden // heads)
    rope_dims = _int(metadata, "llama.rope.dimension_count", head_dim)
    if rope_dims != head_dim:
        raise GGUFConversionError(
            f"partial rotary embedding ({rope_dims} of {head_dim}) unsupported"
        )
    embed = weights["model.embed_tokens.weight"]
    tokens = metadata.get("tokenizer.ggml.tokens") or []
    # The embedding is the ground truth; llama.vocab_size is often absent.
    vocab_size = _int(metadata, "llama.vocab_size", len(tokens) or embed.shape[0])
    if vocab_size != embed.shape[0]:
        raise GGUFConversionError(f"vocab_size {vocab_size} != embedding rows {embed.shape[0]}")

    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": _int(metadata, "llama.feed_forward_length"),
        "num_hidden_layers": _int(metadata, "llama.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": _int(metadata, "llama.attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": _float(metadata, "llama.attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": _float(metadata, "llama.rope.freq_base", 10000.0),
        # convert_hf_to_gguf permutes the q/k rows for llama.cpp's interleaved rope; reading
        # them with traditional (interleaved) rope undoes that without touching the weights.
        "rope_traditional": True,
        "max_position_embeddings": _int(metadata, "llama.context_length", 4096),
        "vocab_size": vocab_size,
        "tie_word_embeddings": "lm_head.weight" not in weights,
        "attention_bias": any(k.endswith("_proj.bias") and ".self_attn." in k for k in weights),
        "mlp_bias": False,
        "hidden_act": "silu",
    }
    rope_scaling = _rope_scaling(metadata)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling

    bos = _optional_int(metadata, "tokenizer.ggml.bos_token_id")
    if bos is not None:
        config["bos_token_id"] = bos
    eos_ids = _eos_token_ids(metadata)
    if eos_ids:
        config["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids

    if module_bits:
        default_bits = Counter(module_bits.values()).most_common(1)[0][0]
        quantization: dict[str, Any] = {
            "group_size": GROUP_SIZE,
            "bits": default_bits,
            "mode": "affine",
        }
        # mlx_lm looks module paths up in this dict before applying the default.
        for module, bits in sorted(module_bits.items()):
            if bits != default_bits:
                quantization[module] = {"group_size": GROUP_SIZE, "bits": bits, "mode": "affine"}
        config["quantization"] = quantization
        config["quantization_config"] = quantization
    return config


def _rope_scaling(metadata: Mapping[str, Any]) -> dict[str, Any] | None:
    kind = metadata.get("llama.rope.scaling.type")
    if kind is None or kind == "none":
        return None
    factor = _float(metadata, "llama.rope.scaling.factor", 1.0)
    if kind == "linear":
        return {"type": "linear", "factor": factor}
    raise GGUFConversionError(f"rope scaling {kind!r} unsupported")


def _eos_token_ids(metadata: Mapping[str, Any]) -> list[int]:
    """EOS first, then end-of-turn / end-of-message tokens that must also stop generation."""
    ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                "tokenizer.ggml.eom_token_id"):  # fmt: skip
        value = _optional_int(metadata, key)
        if value is not None and value not in ids:
            ids.append(value)
    return ids


def _build_tokenizer(metadata: Mapping[str, Any]) -> tuple[Tokenizer, dict[str, Any]]:
    """A byte-level BPE tokenizer equal to llama.cpp's, and its `tokenizer_config.json`."""
    kind = _text(metadata, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFConversionError(f"tokenizer model {kind!r} unsupported (only byte-level BPE)")
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    merges = [tuple(merge.split(" ", 1)) for merge in metadata["tokenizer.ggml.merges"]]
    raw_types = metadata.get("tokenizer.ggml.token_type")
    token_types = raw_types.tolist() if raw_types is not None else [1] * len(tokens)

    vocab = {token: index for index, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise GGUFConversionError("duplicate tokens in tokenizer.ggml.tokens")
    tokenizer = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)
    )
    tokenizer.pre_tokenizer = _pre_tokenizer(str(metadata.get("tokenizer.ggml.pre", "default")))
    tokenizer.decoder = decoders.ByteLevel()

    # Control tokens must never be produced by splitting text, nor be split themselves.
    tokenizer.add_special_tokens(
        [
            AddedToken(token, special=True, normalized=False)
            for token, kind in zip(tokens, token_types, strict=True)
            if kind == _TOKEN_CONTROL
        ]
    )
    tokenizer.add_tokens(
        [
            AddedToken(token, special=False, normalized=False)
            for token, kind in zip(tokens, token_types, strict=True)
            if kind == _TOKEN_USER_DEFINED
        ]
    )

    def token_of(key: str) -> str | None:
        index = _optional_int(metadata, key)
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    bos, eos = token_of("tokenizer.ggml.bos_token_id"), token_of("tokenizer.ggml.eos_token_id")
    before = (
        [bos] if bos is not None and _bool(metadata, "tokenizer.ggml.add_bos_token", False) else []
    )
    after = (
        [eos] if eos is not None and _bool(metadata, "tokenizer.ggml.add_eos_token", False) else []
    )
    add_bos, add_eos = bool(before), bool(after)
    if add_bos or add_eos:
        single = " ".join([*before, "$A", *after])
        pair = " ".join([single, *before, "$B", *after])
        specials = {t for t in (bos if add_bos else None, eos if add_eos else None) if t}
        tokenizer.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=[(t, vocab[t]) for t in specials]
        )
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)

    config: dict[str, Any] = {
        # Load tokenizer.json as written instead of re-deriving a pipeline from a model class.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": token_of("tokenizer.ggml.unknown_token_id"),
        "pad_token": token_of("tokenizer.ggml.padding_token_id"),
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": _int(metadata, "llama.context_length", 4096),
    }
    template = metadata.get("tokenizer.chat_template")
    if isinstance(template, str) and template:
        config["chat_template"] = template
    return tokenizer, {key: value for key, value in config.items() if value is not None}


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer matching llama.cpp's regex for the GGUF's `tokenizer.ggml.pre`."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _GPT2_PRE:
        return byte_level
    if pre in _DIGIT_SPLIT_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    # A wrong regex still tokenizes, just differently from training: refuse rather than guess.
    raise GGUFConversionError(f"pre-tokenizer {pre!r} unsupported")


def _replace_dir(staging: Path, out_dir: Path) -> None:
    """Rename `staging` to `out_dir`, replacing a previous `out_dir` without a partial state."""
    old: Path | None = None
    if out_dir.exists() or out_dir.is_symlink():
        old = _sibling(out_dir, "old")
        out_dir.rename(old)
    try:
        staging.rename(out_dir)
    except BaseException:
        if old is not None:
            old.rename(out_dir)
        raise
    _fsync_dir(out_dir.parent)
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)


def _place_dir(staging: Path, out_dir: Path) -> None:
    """Rename `staging` to `out_dir` only if nothing is there (rename(2) replaces nothing but an
    empty folder): what is already at `out_dir` is never touched."""
    try:
        os.rename(staging, out_dir)
    except OSError as e:
        if e.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
            raise FileExistsError(errno.EEXIST, "already exists", str(out_dir)) from None
        raise
    _fsync_dir(out_dir.parent)


def _sibling(out_dir: Path, kind: str) -> Path:
    """A fresh hidden name beside `out_dir`; same filesystem, so renames between them are atomic."""
    return out_dir.parent / f".{out_dir.name}.{secrets.token_hex(6)}.{kind}"


def _write_json(path: Path, value: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _fsync_tree(directory: Path) -> None:
    # Without this a crash right after the rename could leave a complete-looking directory
    # whose files are still empty on disk.
    for child in directory.iterdir():
        with child.open("rb") as handle:
            os.fsync(handle.fileno())
    _fsync_dir(directory)


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # Not every platform lets a directory be opened (Windows).
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


_MISSING: Any = object()


def _value(metadata: Mapping[str, Any], key: str, default: Any = _MISSING) -> Any:
    if key not in metadata:
        if default is _MISSING:
            raise GGUFConversionError(f"GGUF metadata lacks {key!r}")
        return default
    value = metadata[key]
    if isinstance(value, mx.array):
        if value.ndim != 0:
            raise GGUFConversionError(f"GGUF metadata {key!r} is not a scalar (per-layer values?)")
        return value.item()
    return value


def _int(metadata: Mapping[str, Any], key: str, default: Any = _MISSING) -> int:
    return int(_value(metadata, key, default))


def _optional_int(metadata: Mapping[str, Any], key: str) -> int | None:
    value = _value(metadata, key, None)
    return None if value is None else int(value)


def _float(metadata: Mapping[str, Any], key: str, default: Any = _MISSING) -> float:
    value = float(_value(metadata, key, default))
    # GGUF stores float32: write 1e-05 rather than its float64 widening 9.999999747378752e-06.
    packed = struct.pack("<f", value)
    for digits in range(6, 10):
        shortest = float(f"{value:.{digits}g}")
        if struct.pack("<f", shortest) == packed:
            return shortest
    return value


def _bool(metadata: Mapping[str, Any], key: str, default: bool) -> bool:
    return bool(_value(metadata, key, default))


def _text(metadata: Mapping[str, Any], key: str) -> str:
    return str(_value(metadata, key))
