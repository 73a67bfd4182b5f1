"""The serial decoder, for models whose caches cannot be merged into a batch (mlx-lm's
`ConcatenateKVCache`, `QuantizedKVCache`, ...): the same outputs as the batched path, every
feature included, and a prompt read one chunk per step so a cancel acts within one chunk.

The test model stands in for such a model by making `ConcatenateKVCache` layers, which have
no `merge`; everything else about it is unchanged, so its outputs must equal the batched ones.
"""

from __future__ import annotations

from typing import Any

import pytest
from schedrun import add, collect, job, run, scheduler
from schema_corpus import CORPUS

from jupyter_lmsp.engine.grammars import ResponseFormat, build_grammar
from jupyter_lmsp.engine.worker import encode_chat

pytestmark = pytest.mark.timeout(120)

SEEDED = {"temperature": 1.0, "top_p": 0.9, "seed": 99}
LONG = [{"role": "user", "content": "Tell me about the café on the corner, please. " * 12}]


class Unbatchable:
    """The model, with caches that cannot be batched, recording its calls' shapes."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.calls: list[tuple[int, ...]] = []

    def make_cache(self) -> list[Any]:
        from mlx_lm.models.cache import ConcatenateKVCache

        return [ConcatenateKVCache() for _ in self.model.layers]

    def __call__(self, inputs: Any, cache: Any = None, **kwargs: Any) -> Any:
        self.calls.append(tuple(inputs.shape))
        return self.model(inputs, cache=cache, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


def test_serial_outputs_equal_batched_ones(tiny) -> None:
    model, tok = tiny
    serial = Unbatchable(model)
    grammar = build_grammar(ResponseFormat("json_schema", CORPUS["person"], strict=True), None)
    jobs = [
        dict(max_tokens=30),
        dict(max_tokens=30, **SEEDED),
        dict(max_tokens=30, n=2, **SEEDED),
        dict(max_tokens=30, logprobs=True, top_logprobs=3, stop=["e"]),
        dict(messages=LONG, max_tokens=10),
    ]
    for i, options in enumerate(jobs):
        batched = run(model, tok, [job(f"b{i}", **options)], sched=scheduler(prefill_step=16))
        alone = run(serial, tok, [job(f"b{i}", **options)], sched=scheduler(prefill_step=16))
        assert batched.keys() == alone.keys()
        for key, result in batched.items():
            assert alone[key].tokens == result.tokens, (i, key)
            assert alone[key].text == result.text
            assert alone[key].finish_reason == result.finish_reason
            assert [lp.logprob for lp in alone[key].logprobs] == pytest.approx(
                [lp.logprob for lp in result.logprobs], abs=1e-4
            )
    constrained = run(serial, tok, [job("c", max_tokens=400)], grammar)[("c", 0)]
    expected = run(model, tok, [job("c", max_tokens=400)], grammar)[("c", 0)]
    assert constrained.tokens == expected.tokens and constrained.finish_reason == "stop"


def test_serial_prefill_is_one_chunk_per_step_and_a_cancel_stops_it(tiny) -> None:
    model, tok = tiny
    serial = Unbatchable(model)
    prompt = encode_chat(tok, LONG)
    assert len(prompt) > 100
    sched = scheduler(prefill_step=16)
    results: dict = {}
    add(sched, serial, tok, results, [job("long", messages=LONG, max_tokens=5)])
    for step in range(3):
        collect(results, sched.step())
        assert serial.calls == [(1, 16)] * (step + 1)
    assert sched.cancel("long") == 0
    assert sched.cancel("long") is None  # a second cancel finds nothing
    assert not sched.active
    sched.step()
    assert len(serial.calls) == 3  # nothing more was computed for it

    # Uninterrupted, the whole prompt goes in 16-token chunks (all but its last token), then
    # the last token and each generated token one at a time.
    serial.calls.clear()
    run(serial, tok, [job("whole", messages=LONG, max_tokens=5)], sched=scheduler(prefill_step=16))
    rest, expected = len(prompt) - 1, []
    while rest:
        expected.append((1, min(16, rest)))
        rest -= expected[-1][1]
    assert serial.calls[: len(expected)] == expected
    decode = serial.calls[len(expected) :]
    # One token at a time: the prompt's last token, then each token (one step ahead).
    assert set(decode) == {(1, 1)} and 5 <= len(decode) <= 6
