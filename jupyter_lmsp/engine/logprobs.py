"""Log-probabilities of generated tokens, from the distribution each token was drawn from.

"The distribution" of a step is `sampling.distribution` of the step's log-probabilities:

- the model's log-softmax over the vocabulary, after the grammar mask when the choice is
  constrained (masked tokens have probability 0 and are never listed);
- with sampling (temperature > 0): divided by the temperature, cut to the top_p nucleus and
  normalized again, exactly what the sampler draws from (tokens outside the nucleus have
  probability 0 and are never listed);
- with greedy decoding (temperature 0): the model's distribution itself (temperature 1, no
  nucleus), whose most likely token is the one chosen.

Each generated token gets its log-probability under that distribution and, if asked, the `top`
most likely tokens of the step with theirs (fewer when fewer have any probability). Token text
and bytes come from llguidance's byte-exact view of the tokenizer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from jupyter_lmsp.engine.messages import TokenLogprob, TopLogprob
from jupyter_lmsp.engine.sampling import distribution

if TYPE_CHECKING:
    import llguidance
    import mlx.core as mx


@dataclass
class Wanted:
    """One token whose log-probability is wanted: its step's log-probabilities (the model's,
    after any grammar mask), the token, how it was sampled, and how many alternatives."""

    logprobs: mx.array
    token: int
    temperature: float
    top_p: float
    top: int


class TokenBytes:
    """Each token's bytes (and text), cached, from llguidance's tokenizer."""

    def __init__(self, tokenizer: llguidance.LLTokenizer) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token: int) -> tuple[str, list[int]]:
        found = self._cache.get(token)
        if found is None:
            data = self._tokenizer.decode_bytes([token])
            found = (data.decode("utf-8", errors="replace"), list(data))
            self._cache[token] = found
        return found


def compute(wanted: list[Wanted], token_bytes: list[TokenBytes]) -> list[TokenLogprob]:
    """The log-probabilities of several tokens of one step, evaluated together."""
    import mlx.core as mx

    graphs: list[tuple[mx.array, mx.array | None, mx.array | None]] = []
    for item in wanted:
        dist = distribution(item.logprobs, item.temperature, item.top_p).reshape(-1)
        if item.top > 0:
            top = min(item.top, dist.shape[0])
            best = mx.argpartition(-dist, kth=top - 1)[:top]
            graphs.append((dist[item.token], best, dist[best]))
        else:
            graphs.append((dist[item.token], None, None))
    mx.eval([[array for array in graph if array is not None] for graph in graphs])
    results = []
    for item, names, (chosen, ids, values) in zip(wanted, token_bytes, graphs, strict=True):
        alternatives = []
        if ids is not None and values is not None:
            # A 1-D array's tolist() is a list of Python numbers (mlx's stub says any nesting).
            listed = zip(
                cast(list[float], values.tolist()), cast(list[int], ids.tolist()), strict=True
            )
            ranked = sorted(listed, key=lambda p: (-p[0], p[1]))
            for value, token in ranked:
                if math.isinf(value):  # no probability: outside the nucleus or the grammar
                    continue
                text, data = names(token)
                alternatives.append(TopLogprob(token, text, data, value))
        text, data = names(item.token)
        logprob = cast(float, chosen.item())  # a float32 scalar's item() is a float
        results.append(TokenLogprob(item.token, text, data, logprob, alternatives))
    return results
