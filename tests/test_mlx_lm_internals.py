"""The mlx-lm internals the engine relies on are still there, with the shape it needs.

`engine/spec_batch.py` subclasses mlx-lm's `GenerationBatch` and reads and writes its private
attributes; `engine/batching.py` puts that subclass into `BatchGenerator._generation_batch`;
the samplers, caches, tokenizer and tool-call format lean on other mlx-lm names. None of this is
mlx-lm's public API, so a release may change any of it without notice. `pyproject.toml` pins
mlx-lm to the versions this was tested with; before that pin is raised, run this file against
the new version. Each check says which mlx-lm internal changed, which file of ours uses it, and
which mlx-lm is installed, so a failure reads as "what to port" rather than as a crash deep in
a generation.

Checks are by inspection (`inspect.signature`, the attributes the real classes' `__init__`
sets, dataclass fields) where that shows the shape; where only running shows it (the generator
decoding through the batch put in its place, the prompt batch's caches as `RaggedKVCache` reads
them) they run a few steps of the tiny random-weight test model.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import inspect
import json
import shutil
import tomllib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
VERSION = importlib.metadata.version("mlx-lm")
SPEC_BATCH = "jupyter_lmsp/engine/spec_batch.py"
BATCHING = "jupyter_lmsp/engine/batching.py"


# Who uses each mlx-lm name (for the message when one cannot be imported).
USERS = {
    "GenerationBatch": SPEC_BATCH,
    "StopSequences": f"{SPEC_BATCH} (GenerationBatch._matchers)",
    "TokenBuffer": f"{SPEC_BATCH} (GenerationBatch._token_context)",
    "PromptProcessingBatch": BATCHING,
    "BatchGenerator": BATCHING,
    "generate_step": BATCHING,
    "KVCache": f"{SPEC_BATCH}, jupyter_lmsp/engine/prompt_cache.py",
    "BatchKVCache": SPEC_BATCH,
    "_BaseCache": SPEC_BATCH,
    "dynamic_roll": SPEC_BATCH,
    "make_prompt_cache": BATCHING,
    "create_attention_mask": f"{SPEC_BATCH} (RaggedKVCache.make_mask)",
    "TokenizerWrapper": "jupyter_lmsp/engine/loader.py, worker.py, constraints.py",
    "json_tools": "jupyter_lmsp/engine/toolcalls.py",
    "load_tokenizer": "jupyter_lmsp/engine/tokens.py",
    "apply_top_p": "jupyter_lmsp/engine/sampling.py",
}


def internal(module: str, name: str) -> Any:
    """`from module import name`, failing with the internal's name and who uses it."""
    try:
        found = importlib.import_module(module)
        if hasattr(found, name):
            return getattr(found, name)
        if hasattr(found, "__path__"):  # a package: `name` may be a submodule (tool parsers)
            return importlib.import_module(f"{module}.{name}")
    except ImportError as e:
        raise changed(f"{module}.{name}", USERS.get(name, "jupyter_lmsp/engine"), str(e)) from e
    raise changed(f"{module}.{name}", USERS.get(name, "jupyter_lmsp/engine"), "gone")


def internals(module: str, *names: str) -> tuple[Any, ...]:
    return tuple(internal(module, name) for name in names)


class InternalChanged(AssertionError):
    pass


def changed(internal: str, ours: str, detail: str) -> InternalChanged:
    return InternalChanged(
        f"mlx-lm {VERSION}: `{internal}` is not what {ours} relies on: {detail}. "
        f"See tests/test_mlx_lm_internals.py and the mlx-lm pin in pyproject.toml."
    )


def require(ok: object, internal: str, ours: str, detail: str) -> None:
    if not ok:
        raise changed(internal, ours, detail)


def accepts(func: Callable[..., Any], names: Iterable[str], internal: str, ours: str) -> None:
    """`func` takes each of `names` by keyword and needs no other argument (we pass only
    those)."""
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError) as e:
        raise changed(internal, ours, f"no signature ({e})") from e
    params = signature.parameters
    names = list(names)
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in params.values())
    missing = [n for n in names if n not in params and not takes_kwargs]
    require(not missing, internal, ours, f"no parameter {missing}; it takes {list(params)}")
    needed = [
        n
        for n, p in params.items()
        if n not in names
        and n not in ("self", "cls")
        and p.default is p.empty
        and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    require(not needed, internal, ours, f"now requires {needed}, which we do not pass")


def positional_count(func: Callable[..., Any]) -> int:
    """How many positional parameters `func` has, `self` excluded."""
    params = list(inspect.signature(func).parameters.values())
    count = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)
    return count - (1 if params and params[0].name == "self" else 0)


def has_attributes(obj: object, names: Iterable[str], internal: str, ours: str) -> None:
    missing = [n for n in names if not hasattr(obj, n)]
    require(not missing, internal, ours, f"no attribute {missing}")


# --- the pin ----------------------------------------------------------------------------------


def test_the_installed_mlx_lm_is_within_the_pin() -> None:
    """The installed mlx-lm is one `pyproject.toml` allows: a version outside it has not been
    checked (run this file against it, then move the pin)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = [Requirement(d) for d in project["dependencies"]]
    (pin,) = [r for r in pins if r.name == "mlx-lm"]
    assert any(s.operator in ("<", "<=", "==", "~=") for s in pin.specifier), (
        f"pyproject.toml's `{pin}` has no upper bound: the next mlx-lm release would be "
        "installed unchecked"
    )
    assert pin.specifier.contains(VERSION, prereleases=True), (
        f"mlx-lm {VERSION} is installed, but pyproject.toml allows `{pin}`: run "
        "tests/test_mlx_lm_internals.py against it, then move the pin"
    )


# --- GenerationBatch: the base of SpeculativeGenerationBatch ------------------------------------

# What `SpeculativeGenerationBatch` defines on purpose over mlx-lm's `GenerationBatch`.
OVERRIDES = {"__init__", "Response", "extend", "filter", "extract_cache", "next"}

# The attributes `GenerationBatch.__init__` sets that spec_batch.py reads or writes.
BATCH_ATTRIBUTES = [
    "model",
    "uids",
    "prompt_cache",
    "tokens",
    "samplers",
    "fallback_sampler",
    "logits_processors",
    "stop_sequences",
    "max_tokens",
    "_current_tokens",
    "_next_tokens",
    "_next_logprobs",
    "_token_context",
    "_num_tokens",
    "_matchers",
]


def test_generation_batch_init_takes_what_the_subclass_passes() -> None:
    GenerationBatch = internal("mlx_lm.generate", "GenerationBatch")

    accepts(
        GenerationBatch.__init__,
        [
            "model",
            "uids",
            "inputs",
            "prompt_cache",
            "tokens",
            "samplers",
            "fallback_sampler",
            "logits_processors",
            "stop_sequences",
            "max_tokens",
        ],
        "GenerationBatch.__init__",
        SPEC_BATCH,
    )


def test_generation_batch_init_sets_the_attributes_the_subclass_uses() -> None:
    GenerationBatch = internal("mlx_lm.generate", "GenerationBatch")

    from jupyter_lmsp.engine.sampling import GREEDY

    # An empty batch runs no step, so it needs no model.
    batch = GenerationBatch.empty(model=object(), fallback_sampler=GREEDY)
    has_attributes(batch, BATCH_ATTRIBUTES, "GenerationBatch.__init__", SPEC_BATCH)
    for name in ("_next_logprobs", "_token_context", "_num_tokens", "_matchers", "tokens"):
        require(
            isinstance(getattr(batch, name), list),
            f"GenerationBatch.{name}",
            SPEC_BATCH,
            f"is {type(getattr(batch, name)).__name__}, not a per-row list",
        )


def test_the_methods_the_subclass_overrides_are_still_the_bases() -> None:
    GenerationBatch = internal("mlx_lm.generate", "GenerationBatch")

    from jupyter_lmsp.engine.spec_batch import SpeculativeGenerationBatch

    for name in sorted(OVERRIDES - {"__init__", "Response"}):
        base: Any = getattr(GenerationBatch, name, None)
        require(callable(base), f"GenerationBatch.{name}", SPEC_BATCH, "no such method")
        ours = getattr(SpeculativeGenerationBatch, name)
        require(
            positional_count(base) == positional_count(ours),
            f"GenerationBatch.{name}",
            SPEC_BATCH,
            f"takes {inspect.signature(base)}; the override takes {inspect.signature(ours)}",
        )


def test_the_subclass_shadows_nothing_else_of_the_base() -> None:
    """A name mlx-lm adds to `GenerationBatch` that the subclass also defines (its private
    helpers, `_resolve`, `_emit`...) would silently replace mlx-lm's."""
    GenerationBatch = internal("mlx_lm.generate", "GenerationBatch")

    from jupyter_lmsp.engine.spec_batch import SpeculativeGenerationBatch

    ours = set(vars(SpeculativeGenerationBatch)) - set(vars(object)) - OVERRIDES
    ours -= {"__module__", "__doc__", "__dict__", "__weakref__", "__annotations__"}
    ours -= {"__firstlineno__", "__static_attributes__", "__qualname__"}
    shadowed = sorted(name for name in ours if hasattr(GenerationBatch, name))
    require(
        not shadowed,
        "GenerationBatch",
        SPEC_BATCH,
        f"now defines {shadowed}, which SpeculativeGenerationBatch defines for itself",
    )


def test_generation_batch_response_has_the_fields_we_build_and_read() -> None:
    GenerationBatch = internal("mlx_lm.generate", "GenerationBatch")

    response = GenerationBatch.Response
    require(
        dataclasses.is_dataclass(response),
        "GenerationBatch.Response",
        SPEC_BATCH,
        "is no longer a dataclass (SpeculativeGenerationBatch.Response extends it)",
    )
    fields = {f.name: f for f in dataclasses.fields(response)}
    wanted = ["uid", "token", "logprobs", "finish_reason", "prompt_cache", "all_tokens"]
    missing = [n for n in wanted if n not in fields]
    require(not missing, "GenerationBatch.Response", f"{SPEC_BATCH}, {BATCHING}", f"no {missing}")
    extra = [
        n
        for n, f in fields.items()
        if n not in wanted
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    require(
        not extra,
        "GenerationBatch.Response",
        SPEC_BATCH,
        f"requires {extra}, which SpeculativeGenerationBatch._emit does not give",
    )


def test_stop_sequence_matchers_advance_one_token_at_a_time() -> None:
    StopSequences = internal("mlx_lm.generate", "StopSequences")

    matcher = StopSequences([[5, 6]]).matcher()
    got = [matcher.advance(token) for token in (5, 7, 5, 6)]
    require(
        got == [False, False, False, True],
        "StopSequences.matcher().advance",
        f"{SPEC_BATCH} (GenerationBatch._matchers)",
        f"advancing 5, 7, 5, 6 against the stop [5, 6] gave {got}",
    )


def test_token_context_buffers_append_and_return_the_context() -> None:
    TokenBuffer = internal("mlx_lm.models.cache", "TokenBuffer")

    buffer = TokenBuffer([1, 2])
    got = buffer.update_and_fetch(mx.array([3, 4], dtype=mx.int32)).tolist()
    require(
        got == [1, 2, 3, 4],
        "TokenBuffer.update_and_fetch",
        f"{SPEC_BATCH} (GenerationBatch._token_context)",
        f"[1, 2] then [3, 4] gave {got}",
    )


# --- caches -------------------------------------------------------------------------------------


def _kv(length: int, seed: int) -> Any:
    KVCache = internal("mlx_lm.models.cache", "KVCache")

    cache = KVCache()
    keys = mx.random.normal((1, 2, length, 4), key=mx.random.key(seed))
    cache.update_and_fetch(keys, keys * 2)
    return cache


def test_kv_cache_keeps_keys_values_and_offset() -> None:
    KVCache = internal("mlx_lm.models.cache", "KVCache")

    empty = KVCache()
    users = "jupyter_lmsp/engine/prompt_cache.py, " + SPEC_BATCH
    has_attributes(empty, ["keys", "values", "offset", "nbytes"], "KVCache", users)
    require(empty.keys is None and empty.offset == 0, "KVCache()", users, "is not empty")
    cache = _kv(3, 0)
    require(
        cache.offset == 3 and cache.keys.shape[2] >= 3,
        "KVCache.update_and_fetch",
        users,
        f"3 positions gave offset {cache.offset}, keys {cache.keys.shape}",
    )
    require(
        hasattr(KVCache, "merge"),
        "KVCache.merge",
        BATCHING,
        "gone (batching.py batches only models whose caches merge)",
    )


def test_merged_caches_are_left_padded_as_the_ragged_cache_reads_them() -> None:
    BatchKVCache, KVCache = internals("mlx_lm.models.cache", "BatchKVCache", "KVCache")

    from jupyter_lmsp.engine.spec_batch import RaggedKVCache

    short, long = _kv(3, 1), _kv(5, 2)
    merged = KVCache.merge([short, long])
    require(
        isinstance(merged, BatchKVCache),
        "KVCache.merge",
        SPEC_BATCH,
        f"gives {type(merged).__name__}, not BatchKVCache",
    )
    has_attributes(merged, ["left_padding", "_idx", "keys", "values"], "BatchKVCache", SPEC_BATCH)
    ragged = RaggedKVCache.from_batch(merged)
    require(
        ragged.lengths == [3, 5],
        "BatchKVCache.left_padding / ._idx",
        SPEC_BATCH,
        f"rows of 3 and 5 positions read as {ragged.lengths}",
    )
    assert ragged.keys is not None
    for row, source in enumerate((short, long)):
        n = source.offset
        same = mx.array_equal(ragged.keys[row, :, :n], source.keys[0, :, :n]).item()
        require(
            same,
            "BatchKVCache.keys (left-padded) / dynamic_roll",
            SPEC_BATCH,
            f"row {row}'s keys moved to position 0 differ from its own cache's",
        )


# What `BatchKVCache` has that `RaggedKVCache` does without: `merge` (made by the prompt batch,
# before the rows reach the decode batch), `prepare` / `finalize` (right padding, prompt batch
# only), `keys_and_values` (read only by models that share KV caches across layers, afm7 and
# gemma3n, which therefore cannot speculate).
BATCH_CACHE_UNUSED = {"merge", "prepare", "finalize", "keys_and_values"}


def test_the_ragged_cache_implements_what_the_batch_cache_offers() -> None:
    """`RaggedKVCache` replaces `BatchKVCache` in the decode batch: the model, the batch and the
    generator call these on it."""
    BatchKVCache, _BaseCache = internals("mlx_lm.models.cache", "BatchKVCache", "_BaseCache")

    from jupyter_lmsp.engine.spec_batch import RaggedKVCache

    require(issubclass(RaggedKVCache, _BaseCache), "_BaseCache", SPEC_BATCH, "not a base")
    for name in (
        "update_and_fetch",
        "make_mask",
        "filter",
        "extend",
        "extract",
        "state",
        "is_trimmable",
        "trim",
        "size",
        "empty",
        "nbytes",
    ):
        require(hasattr(BatchKVCache, name), f"BatchKVCache.{name}", SPEC_BATCH, "gone")
    lacking = sorted(
        name
        for name in vars(BatchKVCache)
        if not name.startswith("_") and not hasattr(RaggedKVCache, name)
    )
    unknown = sorted(set(lacking) - BATCH_CACHE_UNUSED)
    require(
        not unknown,
        "BatchKVCache",
        SPEC_BATCH,
        f"has {unknown}, which RaggedKVCache lacks (does the model or the decode batch call them?)",
    )


def test_attention_masks_are_asked_of_the_cache_as_the_ragged_cache_answers() -> None:
    create_attention_mask = internal("mlx_lm.models.base", "create_attention_mask")

    from jupyter_lmsp.engine.spec_batch import RaggedKVCache

    cache = RaggedKVCache([1, 2])
    try:
        mask = create_attention_mask(mx.zeros((2, 3, 8)), cache)
    except TypeError as e:
        raise changed(
            "mlx_lm.models.base.create_attention_mask", SPEC_BATCH, f"calls make_mask so: {e}"
        ) from e
    require(
        mask is not None and tuple(mask.shape) == (2, 1, 3, 5),
        "create_attention_mask",
        SPEC_BATCH,
        f"gave {None if mask is None else mask.shape}, not RaggedKVCache.make_mask's mask",
    )


def test_dynamic_roll_rolls_each_row_by_its_own_shift() -> None:
    dynamic_roll = internal("mlx_lm.models.cache", "dynamic_roll")

    x = mx.broadcast_to(mx.arange(4)[None, None, :, None], (2, 1, 4, 1))
    rolled = dynamic_roll(x, mx.array([[0], [-1]], dtype=mx.int32), axis=2)
    got = rolled[:, 0, :, 0].tolist()
    require(
        got == [[0, 1, 2, 3], [1, 2, 3, 0]],
        "mlx_lm.models.cache.dynamic_roll(x, shifts, axis)",
        SPEC_BATCH,
        f"rows shifted by 0 and -1 gave {got}",
    )


# --- the model, its loading and its tokenizer ---------------------------------------------------


@pytest.fixture(scope="module")
def loaded(test_model_dir: Path) -> tuple[Any, Any]:
    try:
        found = mlx_lm.load(str(test_model_dir))
    except Exception as e:
        raise changed("mlx_lm.load", "jupyter_lmsp/engine/loader.py", repr(e)) from e
    require(
        isinstance(found, tuple) and len(found) >= 2,
        "mlx_lm.load",
        "jupyter_lmsp/engine/loader.py",
        f"returned {type(found).__name__}, not (model, tokenizer, ...)",
    )
    return found[0], found[1]


def test_loaded_models_state_their_vocabulary_and_make_caches(loaded: tuple[Any, Any]) -> None:
    KVCache, make_prompt_cache = internals("mlx_lm.models.cache", "KVCache", "make_prompt_cache")

    model, _ = loaded
    vocab = getattr(getattr(model, "args", None), "vocab_size", None)
    require(
        isinstance(vocab, int),
        "model.args.vocab_size",
        "jupyter_lmsp/engine/constraints.py",
        "a loaded llama model has none",
    )
    layers = make_prompt_cache(model)
    require(
        layers and all(type(layer) is KVCache for layer in layers),
        "make_prompt_cache(model)",
        f"{BATCHING}, jupyter_lmsp/engine/prompt_cache.py",
        f"a llama's cache is {[type(layer).__name__ for layer in layers]}, not KVCache layers",
    )


def test_the_tokenizer_wrapper_has_what_the_engine_reads(loaded: tuple[Any, Any]) -> None:
    TokenizerWrapper = internal("mlx_lm.tokenizer_utils", "TokenizerWrapper")

    _, tokenizer = loaded
    require(
        isinstance(tokenizer, TokenizerWrapper),
        "mlx_lm.load",
        "jupyter_lmsp/engine/loader.py",
        f"gave a {type(tokenizer).__name__}, not a TokenizerWrapper",
    )
    from transformers import PreTrainedTokenizerFast

    require(
        isinstance(getattr(tokenizer, "_tokenizer", None), PreTrainedTokenizerFast),
        "TokenizerWrapper._tokenizer",
        "jupyter_lmsp/engine/constraints.py (llguidance.hf.from_tokenizer)",
        "not the Hugging Face fast tokenizer",
    )
    eos = tokenizer.eos_token_ids
    require(
        eos and all(isinstance(t, int) for t in eos),
        "TokenizerWrapper.eos_token_ids",
        f"{BATCHING}, jupyter_lmsp/engine/constraints.py",
        f"is {eos!r}",
    )
    require(
        isinstance(getattr(tokenizer, "init_kwargs", None), dict),
        "TokenizerWrapper.init_kwargs",
        "jupyter_lmsp/engine/worker.py, jupyter_lmsp/engine/tokens.py (tool_parser_type)",
        "not a dict",
    )
    messages = [{"role": "user", "content": "hello"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    require(
        isinstance(prompt, str),
        "TokenizerWrapper.apply_chat_template(tokenize=False)",
        "jupyter_lmsp/engine/worker.py",
        f"gave {type(prompt).__name__}",
    )
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    require(
        ids and all(isinstance(t, int) for t in ids),
        "TokenizerWrapper.encode(add_special_tokens=False)",
        "jupyter_lmsp/engine/worker.py",
        f"gave {ids!r}",
    )
    detokenizer = tokenizer.detokenizer
    has_attributes(
        detokenizer,
        ["add_token", "finalize", "text"],
        "TokenizerWrapper.detokenizer",
        "jupyter_lmsp/engine/stops.py",
    )
    for token in ids:
        detokenizer.add_token(token)
    detokenizer.finalize()
    require(
        detokenizer.text == tokenizer.decode(ids),
        "TokenizerWrapper.detokenizer.text",
        "jupyter_lmsp/engine/stops.py",
        "the streamed text is not the decoded text",
    )


def test_load_tokenizer_reports_the_tool_parser(test_model_dir: Path, tmp_path: Path) -> None:
    json_tools = internal("mlx_lm.tool_parsers", "json_tools")
    load_tokenizer = internal("mlx_lm.utils", "load_tokenizer")

    from jupyter_lmsp.engine.grammars import GENERIC

    users = "jupyter_lmsp/engine/toolcalls.py (NATIVE_FORMATS)"
    require(
        (json_tools.tool_call_start, json_tools.tool_call_end) == (GENERIC.start, GENERIC.end),
        "mlx_lm.tool_parsers.json_tools.tool_call_start/_end",
        users,
        f"now {json_tools.tool_call_start!r} / {json_tools.tool_call_end!r}, not the generic "
        "format's markers",
    )
    model_dir = shutil.copytree(test_model_dir, tmp_path / "model")
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "tool_parser_type": "json_tools"}))
    accepts(load_tokenizer, ["model_path", "eos_token_ids"], "load_tokenizer", "tokens.py")
    tokenizer = load_tokenizer(model_dir, eos_token_ids=None)
    require(
        tokenizer.init_kwargs.get("tool_parser_type") == "json_tools",
        "TokenizerWrapper.init_kwargs['tool_parser_type']",
        "jupyter_lmsp/engine/worker.py, jupyter_lmsp/engine/tokens.py",
        f"a tokenizer_config naming json_tools gave {tokenizer.init_kwargs.get('tool_parser_type')!r}",
    )


def test_apply_top_p_keeps_the_nucleus() -> None:
    apply_top_p = internal("mlx_lm.sample_utils", "apply_top_p")

    logprobs = mx.log(mx.array([[0.6, 0.3, 0.1]]))
    try:
        kept = apply_top_p(logprobs, 0.8)
    except TypeError as e:
        raise changed("apply_top_p(logprobs, top_p)", "sampling.py", str(e)) from e
    finite = mx.isfinite(kept)[0].tolist()
    require(
        tuple(kept.shape) == (1, 3) and finite == [True, True, False],
        "mlx_lm.sample_utils.apply_top_p",
        "jupyter_lmsp/engine/sampling.py",
        f"top_p 0.8 over (0.6, 0.3, 0.1) kept {finite}",
    )


# --- BatchGenerator and generate_step, as batching.py drives them -------------------------------


def test_batch_generator_takes_what_batching_passes() -> None:
    BatchGenerator = internal("mlx_lm.generate", "BatchGenerator")

    accepts(
        BatchGenerator.__init__,
        [
            "model",
            "stop_tokens",
            "completion_batch_size",
            "prefill_batch_size",
            "prefill_step_size",
        ],
        "BatchGenerator.__init__",
        BATCHING,
    )
    accepts(
        BatchGenerator.insert_segments,
        ["segments", "max_tokens", "caches", "all_tokens", "samplers", "logits_processors"],
        "BatchGenerator.insert_segments",
        BATCHING,
    )
    accepts(
        BatchGenerator.remove,
        ["uids", "return_prompt_caches"],
        "BatchGenerator.remove",
        BATCHING,
    )
    accepts(BatchGenerator.extract_cache, ["uids"], "BatchGenerator.extract_cache", BATCHING)
    accepts(BatchGenerator.next, [], "BatchGenerator.next", BATCHING)
    require(callable(getattr(BatchGenerator, "close", None)), "BatchGenerator.close", BATCHING, "")
    PromptProcessingBatch = internal("mlx_lm.generate", "PromptProcessingBatch")

    fields = {f.name for f in dataclasses.fields(PromptProcessingBatch.Response)}
    wanted = {"uid", "end_of_segment", "end_of_prompt"}
    require(
        wanted <= fields,
        "PromptProcessingBatch.Response",
        BATCHING,
        f"no {sorted(wanted - fields)} (the prefill progress batching.py reads)",
    )


def test_generate_step_takes_what_the_serial_decoder_passes() -> None:
    generate_step = internal("mlx_lm.generate", "generate_step")

    accepts(
        generate_step,
        [
            "prompt",
            "model",
            "max_tokens",
            "sampler",
            "logits_processors",
            "prompt_cache",
            "prefill_step_size",
        ],
        "mlx_lm.generate.generate_step",
        f"{BATCHING} (_SerialDecoder)",
    )


def _generator(model: Any, tokenizer: Any) -> Any:
    BatchGenerator = internal("mlx_lm.generate", "BatchGenerator")

    return BatchGenerator(
        model,
        stop_tokens=[[token] for token in sorted(tokenizer.eos_token_ids)],
        completion_batch_size=4,
        prefill_batch_size=4,
        prefill_step_size=64,
    )


def _decode(generator: Any, prompts: list[list[int]], max_tokens: int) -> dict[int, list[int]]:
    """Every sequence's tokens, as batching.py's `_BatchDecoder` inserts and steps them."""
    from jupyter_lmsp.engine.sampling import GREEDY

    uids = generator.insert_segments(
        [[prompt] for prompt in prompts],
        max_tokens=[max_tokens] * len(prompts),
        caches=None,
        all_tokens=[[] for _ in prompts],
        samplers=[GREEDY] * len(prompts),
        logits_processors=[[] for _ in prompts],
    )
    got: dict[int, list[int]] = {uid: [] for uid in uids}
    finished: set[int] = set()
    for _ in range(10 * max_tokens + 20):
        step = generator.next()
        require(
            isinstance(step, tuple) and len(step) == 2,
            "BatchGenerator.next",
            BATCHING,
            f"returned {type(step).__name__}, not (prompt_responses, generation_responses)",
        )
        for response in step[1]:
            got[response.uid].append(response.token)
            if response.finish_reason is not None:
                finished.add(response.uid)
        if finished == set(uids):
            break
    require(
        finished == set(uids),
        "BatchGenerator.next",
        BATCHING,
        f"sequences {sorted(set(uids) - finished)} never finished",
    )
    return {i: got[uid] for i, uid in enumerate(uids)}


def test_the_generator_decodes_through_the_batch_put_in_its_place(
    loaded: tuple[Any, Any],
) -> None:
    """batching.py sets `BatchGenerator._generation_batch` to a `SpeculativeGenerationBatch`:
    the generator must hand it the prefilled rows (`extend`) and step it (`next`), and greedy
    tokens must be those of mlx-lm's own batch (speculation changes no token)."""
    GenerationBatch = internal("mlx_lm.generate", "GenerationBatch")

    from jupyter_lmsp.engine.spec_batch import SpeculativeGenerationBatch
    from jupyter_lmsp.engine.speculative import SpeculationSettings
    from jupyter_lmsp.engine.worker import encode_chat

    model, tokenizer = loaded
    # Long enough for the test model to repeat itself, so rows find n-gram proposals; a verify
    # step whenever a row has one (every step costs the same to the planner).
    questions = ["Tell me about the café on the corner.", "Why?"]
    prompts = [encode_chat(tokenizer, [{"role": "user", "content": q}]) for q in questions]
    plain = _generator(model, tokenizer)
    require(
        isinstance(getattr(plain, "_generation_batch", None), GenerationBatch),
        "BatchGenerator._generation_batch",
        BATCHING,
        "not the generator's GenerationBatch",
    )
    expected = _decode(plain, prompts, 60)
    plain.close()

    settings = SpeculationSettings(
        verify_cost=(0.0, 0.0), sync_cost=0.0, learn_costs=False, max_rows=8
    )
    generator = _generator(model, tokenizer)
    try:
        batch = SpeculativeGenerationBatch(
            model, generator.sampler, settings, tokenizer.eos_token_ids, None
        )
        generator._generation_batch = batch
        got = _decode(generator, prompts, 60)
    except InternalChanged:
        raise
    except Exception as e:  # a changed private attribute shows as any error, deep inside
        raise changed(
            "GenerationBatch internals", SPEC_BATCH, f"decoding through the subclass: {e!r}"
        ) from e
    require(
        batch.stats.steps > 0,
        "BatchGenerator._generation_batch",
        BATCHING,
        "the generator no longer decodes through the batch put there",
    )
    require(
        batch.stats.verify_steps > 0,
        "GenerationBatch internals (_next_tokens, _token_context, _matchers, ...)",
        SPEC_BATCH,
        "no verify step ran in 60 tokens of the test model",
    )
    require(
        got == expected,
        "GenerationBatch internals (_next_tokens, _num_tokens, _matchers, prompt_cache)",
        SPEC_BATCH,
        f"speculative greedy tokens {got} differ from mlx-lm's own {expected}",
    )
    generator.close()


def test_the_generator_returns_and_removes_sequences_with_their_caches(
    loaded: tuple[Any, Any],
) -> None:
    from jupyter_lmsp.engine.sampling import GREEDY

    model, tokenizer = loaded
    generator = _generator(model, tokenizer)
    uids = generator.insert_segments(
        [[[5, 6, 7], [8, 9, 10]], [[11, 12, 13, 14]]],
        max_tokens=[8, 8],
        caches=None,
        all_tokens=[[], []],
        samplers=[GREEDY, GREEDY],
        logits_processors=[[], []],
    )
    prefilled = []
    for _ in range(4):
        progress, _ = generator.next()
        prefilled += [r.uid for r in progress if r.end_of_segment and not r.end_of_prompt]
    # The generator splits the last token off the last segment (decoding starts from it): the
    # first sequence ends two segments before it ([5, 6, 7], [8, 9]), the second one ([11..13]).
    require(
        sorted(prefilled) == sorted([uids[0], uids[0], uids[1]]),
        "PromptProcessingBatch.Response.end_of_segment / end_of_prompt",
        BATCHING,
        f"segment ends were reported for {prefilled}, not twice {uids[0]} and once {uids[1]}",
    )
    found = generator.extract_cache(uids)
    require(
        set(found) == set(uids)
        and all(isinstance(c, list) and isinstance(t, list) for c, t in found.values()),
        "BatchGenerator.extract_cache(uids)",
        BATCHING,
        f"gave {found!r}, not {{uid: (cache layers, tokens)}}",
    )
    removed = generator.remove([uids[1]], return_prompt_caches=True)
    require(
        set(removed) == {uids[1]} and len(removed[uids[1]]) == 2,
        "BatchGenerator.remove(uids, return_prompt_caches=True)",
        BATCHING,
        f"gave {removed!r}, not {{uid: (cache layers, tokens)}}",
    )
    generator.close()


def test_generate_step_yields_a_token_and_its_log_probabilities(loaded: tuple[Any, Any]) -> None:
    generate_step = internal("mlx_lm.generate", "generate_step")
    make_prompt_cache = internal("mlx_lm.models.cache", "make_prompt_cache")

    from jupyter_lmsp.engine.sampling import GREEDY

    model, _ = loaded
    steps = generate_step(
        mx.array([5, 6, 7]),
        model,
        max_tokens=2,
        sampler=GREEDY,
        logits_processors=None,
        prompt_cache=make_prompt_cache(model),
        prefill_step_size=64,
    )
    token, logprobs = next(steps)
    steps.close()
    require(
        isinstance(token, int) and logprobs.ndim == 1,
        "generate_step",
        f"{BATCHING} (_SerialDecoder)",
        f"yielded {type(token).__name__} and {getattr(logprobs, 'shape', None)}, "
        "not a token id and a vocabulary's log-probabilities",
    )
