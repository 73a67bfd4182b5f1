"""The mlx-lm internals the engine relies on, as running the tiny test model shows them.

The companion of tests/test_mlx_lm_internals.py (which inspects, without a model): loading a
model and its tokenizer as `engine/loader.py` does and reading what the engine reads of them;
`BatchGenerator` driven as `engine/batching.py` drives it, with `SpeculativeGenerationBatch`
put in place of its decode batch, giving the tokens mlx-lm's own batch gives; the serial
decoder's `generate_step`; and mlx-lm's top-p filter. A failure names the internal, our file
and the mlx-lm version.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
from mlxlm import (
    BATCHING,
    SPEC_BATCH,
    InternalChanged,
    accepts,
    changed,
    has_attributes,
    internal,
    internals,
    require,
)

# --- the model, its loading and its tokenizer ---------------------------------------------------


def test_mlx_lm_load_gives_the_model_and_its_tokenizer(test_model_dir: Path) -> None:
    """What `engine/loader.py` (and the shared `tiny` fixture the other tests here use) take
    from `mlx_lm.load`: a tuple whose first two items are the model and its tokenizer."""
    TokenizerWrapper = internal("mlx_lm.tokenizer_utils", "TokenizerWrapper")
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
    require(
        callable(found[0]) and isinstance(found[1], TokenizerWrapper),
        "mlx_lm.load",
        "jupyter_lmsp/engine/loader.py",
        f"gave ({type(found[0]).__name__}, {type(found[1]).__name__}), not (a model, a "
        "TokenizerWrapper)",
    )


def test_loaded_models_state_their_vocabulary_and_make_caches(tiny: tuple[Any, Any]) -> None:
    KVCache, make_prompt_cache = internals("mlx_lm.models.cache", "KVCache", "make_prompt_cache")

    model, _ = tiny
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


def test_the_tokenizer_wrapper_has_what_the_engine_reads(tiny: tuple[Any, Any]) -> None:
    TokenizerWrapper = internal("mlx_lm.tokenizer_utils", "TokenizerWrapper")

    _, tokenizer = tiny
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
    require(
        detokenizer is not tokenizer.detokenizer,
        "TokenizerWrapper.detokenizer",
        f"{BATCHING} (a TextStream per choice)",
        "two reads gave the same object: choices decoding at once would share its state",
    )
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
    tiny: tuple[Any, Any],
) -> None:
    """batching.py sets `BatchGenerator._generation_batch` to a `SpeculativeGenerationBatch`:
    the generator must hand it the prefilled rows (`extend`) and step it (`next`), and greedy
    tokens must be those of mlx-lm's own batch (speculation changes no token)."""
    GenerationBatch = internal("mlx_lm.generate", "GenerationBatch")

    from jupyter_lmsp.engine.spec_batch import SpeculativeGenerationBatch
    from jupyter_lmsp.engine.speculative import SpeculationSettings
    from jupyter_lmsp.engine.worker import encode_chat

    model, tokenizer = tiny
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
    tiny: tuple[Any, Any],
) -> None:
    from jupyter_lmsp.engine.sampling import GREEDY

    model, tokenizer = tiny
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


def test_generate_step_yields_a_token_and_its_log_probabilities(tiny: tuple[Any, Any]) -> None:
    generate_step = internal("mlx_lm.generate", "generate_step")
    make_prompt_cache = internal("mlx_lm.models.cache", "make_prompt_cache")

    from jupyter_lmsp.engine.sampling import GREEDY

    model, _ = tiny
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
