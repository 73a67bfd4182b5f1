"""Deterministic samplers for the inference worker.

A sampler turns one step's log-probabilities into a token id, in the shape `mlx_lm`'s
`generate_step` expects. Greedy decoding is the argmax. Random sampling draws each step with a
key derived only from (seed, position), never from MLX's global random state: a generation
resumed at position k (prompt + first k tokens re-prefilled) then draws exactly the tokens an
uninterrupted run would have drawn. A global `mx.random.seed` cannot do that, because the
state it leaves after k steps is not reproduced by re-prefilling (and it is per thread).

`distribution` is the distribution a sampler draws from, the one log-probabilities are reported
for (see `logprobs`). The choices of a job with n > 1 draw with `choice_seed(seed, i)`.

Samplers can also `draw` a given position without moving on: speculative decoding draws the
positions of a verify step together and keeps a proposed token only if it equals the draw at
its position, so speculating changes no token, greedy or seeded.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_p

Sampler = Callable[[mx.array], mx.array]

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """One round of SplitMix64: a cheap, well-mixed bijection on 64-bit integers."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def choice_seed(seed: int, choice: int) -> int:
    """The seed of choice `choice` of a job seeded `seed`: choice 0 keeps `seed` (so n == 1 is
    unchanged), the others get well-mixed seeds of their own, the same on every run."""
    if choice == 0:
        return seed
    return _splitmix64((seed & _MASK64) ^ _splitmix64(0xC401CE ^ choice))


def step_key(seed: int, position: int) -> mx.array:
    """The random key for the token at `position` (0 = first generated token) of a run."""
    return mx.random.key(_splitmix64(_splitmix64(seed & _MASK64) ^ (position & _MASK64)))


class GreedySampler:
    """The argmax: the same token at every position. One instance (`GREEDY`) serves every greedy
    choice, so a batch of greedy rows is sampled in one call."""

    def __call__(self, logprobs: mx.array) -> mx.array:
        return mx.argmax(logprobs, axis=-1)

    def draw(self, logprobs: mx.array, position: int) -> mx.array:
        return mx.argmax(logprobs, axis=-1)


GREEDY = GreedySampler()


class KeyedSampler:
    """Seeded sampling: the token at each position drawn with `step_key(seed, position)`.

    Called as a sampler (`generate_step`, mlx-lm's decode step), it draws at `position` and
    moves on: the calls come exactly once per generated token, in order (the one computed ahead
    of the end is simply never used). `draw` samples any position without moving: speculative
    decoding draws the positions of a verify step together, then sets `position` past the
    tokens it kept, so the same position always gets the same key, speculating or not.
    """

    def __init__(self, temperature: float, top_p: float, seed: int, position: int = 0) -> None:
        self.temperature = temperature
        self.top_p = top_p
        self.seed = seed
        self.position = position

    def __call__(self, logprobs: mx.array) -> mx.array:
        token = self.draw(logprobs, self.position)
        self.position += 1
        return token

    def draw(self, logprobs: mx.array, position: int) -> mx.array:
        return mx.random.categorical(
            _tempered(logprobs, self.temperature, self.top_p), key=step_key(self.seed, position)
        )


def make_sampler(
    temperature: float, top_p: float = 1.0, seed: int = 0, start_position: int = 0
) -> GreedySampler | KeyedSampler:
    """A sampler for `generate_step`: greedy when `temperature` is 0, else seeded sampling
    whose first call samples position `start_position` (the number of tokens already generated
    when resuming)."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if temperature == 0:
        return GREEDY
    return KeyedSampler(temperature, top_p, seed, start_position)


def distribution(logprobs: mx.array, temperature: float, top_p: float = 1.0) -> mx.array:
    """The log-probabilities a sampler made by `make_sampler(temperature, top_p)` draws from,
    given the step's `logprobs` (the model's, after any grammar mask): tempered, cut to the
    nucleus (-inf outside it) and normalized. Greedy decoding (temperature 0) reports the
    model's own distribution, `logprobs` unchanged: its argmax is the token chosen, and a
    distribution at temperature 0 would be a point mass that says nothing."""
    if temperature == 0:
        return logprobs
    logits = _tempered(logprobs, temperature, top_p)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def _tempered(logprobs: mx.array, temperature: float, top_p: float) -> mx.array:
    # Temperature first, then the nucleus, as Hugging Face and OpenAI define top_p
    # (mlx-lm's own sampler cuts the nucleus from the untempered distribution).
    logits = logprobs * (1.0 / temperature)
    if top_p < 1.0:
        logits = apply_top_p(logits, top_p)
    return logits
