"""The mlx-lm internals the engine relies on are still there, with the shape it needs.

`engine/spec_batch.py` subclasses mlx-lm's `GenerationBatch` and reads and writes its private
attributes; `engine/batching.py` puts that subclass into `BatchGenerator._generation_batch`;
the samplers, caches, tokenizer and tool-call format lean on other mlx-lm names. None of this is
mlx-lm's public API, so a release may change any of it without notice. `pyproject.toml` pins
mlx-lm to the versions this was tested with; before that pin is raised, run this file and
tests/test_mlx_lm_runs.py against the new version. Each check says which mlx-lm internal
changed, which file of ours uses it, and which mlx-lm is installed (`mlxlm.changed`), so a
failure reads as "what to port" rather than as a crash deep in a generation.

Here the checks are by inspection, without a model: `inspect.signature`, the attributes the
real classes' `__init__` sets, dataclass fields, small calls on made-up arrays.
tests/test_mlx_lm_runs.py checks what only running the tiny test model shows.
"""

from __future__ import annotations

import dataclasses
import inspect
import tomllib
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlxlm import (
    BATCHING,
    SPEC_BATCH,
    VERSION,
    accepts,
    changed,
    has_attributes,
    internal,
    internals,
    positional_count,
    require,
)
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent


# --- the pin ----------------------------------------------------------------------------------


def test_the_installed_mlx_lm_is_within_the_pin() -> None:
    """The installed mlx-lm is one `pyproject.toml` allows: a version outside it has not been
    checked (run this file and tests/test_mlx_lm_runs.py against it, then move the pin)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = [Requirement(d) for d in project["dependencies"]]
    (pin,) = [r for r in pins if r.name == "mlx-lm"]
    assert any(s.operator in ("<", "<=", "==", "~=") for s in pin.specifier), (
        f"pyproject.toml's `{pin}` has no upper bound: the next mlx-lm release would be "
        "installed unchecked"
    )
    assert pin.specifier.contains(VERSION, prereleases=True), (
        f"mlx-lm {VERSION} is installed, but pyproject.toml allows `{pin}`: run "
        "tests/test_mlx_lm_internals.py and tests/test_mlx_lm_runs.py against it, then move "
        "the pin"
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
# only); `keys_and_values` is read by models that reuse one layer's keys and values in later
# layers: gemma3n never speculates (rotating layers), afm7 would and would fail (a known gap,
# docs/architecture.md).
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
    wanted = {"uid", "progress", "end_of_segment", "end_of_prompt"}
    require(
        wanted <= fields,
        "PromptProcessingBatch.Response",
        BATCHING,
        f"no {sorted(wanted - fields)} (the prefill progress batching.py reads)",
    )
    # batching.py sets it before each step for that step's chunks (cost-sized: prefill.py);
    # tests/test_prefill_fairness.py sees whether the step still reads it.
    source = inspect.getsource(BatchGenerator._next)
    require(
        "self.prefill_step_size" in source,
        "BatchGenerator._next",
        BATCHING,
        "no longer reads self.prefill_step_size for each step's prompt chunks",
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
