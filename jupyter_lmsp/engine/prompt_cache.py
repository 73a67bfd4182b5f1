"""The prompt cache: KV caches of earlier jobs, reused by later jobs whose context shares a prefix.

A follow-up turn's prompt starts with the previous turn's prompt and reply, and concurrent jobs
often share a system prompt; recomputing that prefix is most of the time-to-first-token on a
CPU. `PromptCache` keeps the KV cache of each finished (or prefilled, or cancelled) sequence,
keyed by the model and the exact tokens the cache holds, in least-recently-used order within a
byte budget. `fetch` finds the entry sharing the longest prefix with a new context and returns
a private view of its first n positions; the caller prefills only the rest.

Only plain `KVCache` layers are reused: they can be cut to any prefix by slicing. Rotating,
quantized or recurrent caches cannot, so models using them always prefill cold.

Aliasing: a view returned by `fetch` shares memory with the stored entry. That is safe because
MLX arrays are values: `KVCache.update_and_fetch` on a view whose buffer is full allocates and
concatenates instead of writing into the shared buffer, and a slice assignment never writes
through to another array that shares its data. Callers hand over what they `insert` and must not
update it afterwards.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

# Default budget for all cached KV entries together. SmolLM2-135M in float32 needs ~46 KB per
# token, so this holds ~23k tokens of context; a 7B model in float16, ~8k.
DEFAULT_PROMPT_CACHE_BYTES = 1 << 30

# Token lists are compared in blocks of this many (a C-speed slice comparison), then one by one.
_COMPARE_BLOCK = 128


def common_prefix_length(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = min(len(a), len(b))
    start = 0
    while start < n:
        end = min(start + _COMPARE_BLOCK, n)
        if a[start:end] != b[start:end]:
            break
        start = end
    else:
        return n
    while a[start] == b[start]:
        start += 1
    return start


def is_reusable(cache: Sequence[Any]) -> bool:
    """Whether `cache` (one entry per layer) can be cut to a prefix, i.e. is all plain KVCache."""
    from mlx_lm.models.cache import KVCache

    return bool(cache) and all(type(layer) is KVCache for layer in cache)


def prefix_view(cache: Sequence[Any], length: int) -> list[Any]:
    """New `KVCache` layers holding the first `length` positions of `cache` (no copy is made)."""
    from mlx_lm.models.cache import KVCache

    view = []
    for layer in cache:
        part = KVCache()
        if length > 0:
            part.keys = layer.keys[..., :length, :]
            part.values = layer.values[..., :length, :]
            part.offset = length
        view.append(part)
    return view


def cache_nbytes(cache: Sequence[Any]) -> int:
    return sum(layer.nbytes for layer in cache)


def bytes_per_position(cache: Sequence[Any]) -> int:
    """The bytes one position takes in `cache` (keys and values of every layer); a layer's
    arrays may hold room for more positions than it uses."""
    return sum(
        (layer.keys.nbytes + layer.values.nbytes) // layer.keys.shape[2]
        for layer in cache
        if layer.keys is not None and layer.keys.shape[2]
    )


@dataclass
class _Entry:
    model_key: Hashable
    tokens: tuple[int, ...]
    cache: list[Any]
    nbytes: int


@dataclass(frozen=True)
class CacheStats:
    """Counters since the cache was made: lookups, hits and reused tokens, entries and bytes now;
    the bytes of key/value cache the reused tokens took from it."""

    lookups: int
    hits: int
    reused_tokens: int
    entries: int
    nbytes: int
    reused_bytes: int = 0


class PromptCache:
    """An LRU of KV caches keyed by (model key, tokens), within `max_bytes` in total."""

    def __init__(self, max_bytes: int = DEFAULT_PROMPT_CACHE_BYTES) -> None:
        self._entries: OrderedDict[tuple[Hashable, tuple[int, ...]], _Entry] = OrderedDict()
        self._max_bytes = max(0, max_bytes)
        self._nbytes = 0
        self._lookups = 0
        self._hits = 0
        self._reused = 0
        self._reused_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def max_bytes(self) -> int:
        return self._max_bytes

    @max_bytes.setter
    def max_bytes(self, value: int) -> None:
        self._max_bytes = max(0, value)
        self._evict()

    def stats(self) -> CacheStats:
        return CacheStats(
            self._lookups, self._hits, self._reused, len(self), self._nbytes, self._reused_bytes
        )

    def fetch(self, model_key: Hashable, tokens: Sequence[int]) -> tuple[list[Any] | None, int]:
        """A cache holding the longest cached prefix of `tokens`, and that prefix's length.

        At most len(tokens) - 1 positions are reused: the last token must still go through the
        model to give the logits of the first new token. Returns (None, 0) when nothing is
        shared. The returned cache is the caller's own (a view; see the module docstring).
        """
        self._lookups += 1
        wanted = tuple(tokens)
        best: _Entry | None = None
        best_length = 0
        for entry in self._entries.values():
            if entry.model_key != model_key:
                continue
            length = common_prefix_length(entry.tokens, wanted)
            if length > best_length:
                best, best_length = entry, length
        usable = min(best_length, len(wanted) - 1)
        if best is None or usable <= 0:
            return None, 0
        self._entries.move_to_end((best.model_key, best.tokens))
        self._hits += 1
        self._reused += usable
        self._reused_bytes += usable * bytes_per_position(best.cache)
        return prefix_view(best.cache, usable), usable

    def insert(self, model_key: Hashable, tokens: Sequence[int], cache: list[Any]) -> bool:
        """Keep `cache`, which holds exactly the positions of `tokens`; False if not kept.

        Entries whose tokens are a prefix of `tokens` are dropped: the new entry serves them.
        If an entry already extends `tokens`, that one is kept (and refreshed) instead.
        """
        key_tokens = tuple(tokens)
        if not key_tokens or not is_reusable(cache):
            return False
        if any(layer.offset != len(key_tokens) for layer in cache):
            # A bookkeeping slip must cost only a cache miss, never a wrong reuse.
            log.warning(
                "not caching: %d tokens vs %d cached positions", len(key_tokens), cache[0].offset
            )
            return False
        for key, entry in list(self._entries.items()):
            if entry.model_key != model_key:
                continue
            shared = common_prefix_length(entry.tokens, key_tokens)
            if shared == len(key_tokens):  # an entry already holds all of these positions
                self._entries.move_to_end(key)
                return False
            if shared == len(entry.tokens):
                self._remove(key)
        import mlx.core as mx

        # Materialize now, so the entry holds its own data rather than a graph that keeps
        # (say) a whole batch's cache alive.
        mx.eval([[layer.keys, layer.values] for layer in cache])
        entry = _Entry(model_key, key_tokens, cache, cache_nbytes(cache))
        self._entries[(model_key, key_tokens)] = entry
        self._nbytes += entry.nbytes
        self._evict()
        return (model_key, key_tokens) in self._entries

    def clear(self, model_key: Hashable | None = None) -> None:
        """Forget every entry (of `model_key` only, if given)."""
        for key, entry in list(self._entries.items()):
            if model_key is None or entry.model_key == model_key:
                self._remove(key)

    def _remove(self, key: tuple[Hashable, tuple[int, ...]]) -> None:
        entry = self._entries.pop(key)
        self._nbytes -= entry.nbytes

    def _evict(self) -> None:
        while self._entries and self._nbytes > self._max_bytes:
            self._remove(next(iter(self._entries)))
