"""Which models stay loaded in the inference worker (issue 39): a memory budget and idle unload.

Any number of models may be loaded at once while their weights fit in `max_loaded_bytes`
(0: half the machine's memory). When a load makes them exceed it, the least recently used
*idle* models are unloaded first until they fit; a model with work in flight (a job decoding
or prefilling on it, embeddings queued for it, jobs waiting for it) is never unloaded, so the
worker may run over budget while every model is busy, and gets back under it as they go idle.

Idle unload: a model unused for its `keep_alive` seconds is unloaded. Its keep-alive is the
worker's (`WorkerSettings.keep_alive`, the `LMSPExtension.keep_alive` trait: 300 s by default)
unless the last job on it named its own, as Ollama's requests do: 0 unloads it as soon as that
job is done, a negative value keeps it until it is evicted for room or asked to unload.

A model's bytes are its arrays' (`nn.Module.parameters()`), the weights that stay resident;
the prompt cache has its own budget (`prompt_cache_bytes`).

`Residency` is the bookkeeping only (no MLX): the worker asks it which models to unload.
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Any

DEFAULT_KEEP_ALIVE = 300.0


def default_budget() -> int:
    """Half the machine's physical memory (the rest for the server, the prompt cache, the
    other programs)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    except (ValueError, OSError, AttributeError):
        return 8 << 30


def model_bytes(model: object) -> int:
    """The bytes of a loaded mlx-lm model's arrays."""
    from mlx.utils import tree_flatten

    parameters = getattr(model, "parameters", None)
    if parameters is None:
        return 0
    arrays: Any = tree_flatten(parameters())
    return sum(int(array.nbytes) for _, array in arrays)


@dataclass
class _Resident:
    nbytes: int
    used: float
    keep_alive: float


class Residency:
    def __init__(
        self,
        max_bytes: int = 0,
        keep_alive: float = DEFAULT_KEEP_ALIVE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_bytes = max_bytes if max_bytes > 0 else default_budget()
        self.keep_alive = keep_alive
        self._clock = clock
        self._models: OrderedDict[Hashable, _Resident] = OrderedDict()

    @property
    def resident_bytes(self) -> int:
        return sum(m.nbytes for m in self._models.values())

    def __contains__(self, key: Hashable) -> bool:
        return key in self._models

    def keys(self) -> list[Any]:
        """Loaded models, least recently used first."""
        return list(self._models)

    def nbytes(self, key: Hashable) -> int:
        resident = self._models.get(key)
        return resident.nbytes if resident is not None else 0

    def loaded(self, key: Hashable, nbytes: int) -> None:
        self._models[key] = _Resident(nbytes, self._clock(), self.keep_alive)

    def used(self, key: Hashable, keep_alive: float | None = None) -> None:
        """A job ran (or will run) on the model: it is the most recently used, and its idle
        time counts from now; `keep_alive` (None: the worker's) is the job's own."""
        resident = self._models.get(key)
        if resident is None:
            return
        resident.used = self._clock()
        if keep_alive is not None:
            resident.keep_alive = keep_alive
        self._models.move_to_end(key)

    def unloaded(self, key: Hashable) -> None:
        self._models.pop(key, None)

    def over_budget(self, busy: Iterable[Hashable]) -> list[Any]:
        """The idle models to unload, least recently used first, so the rest fit the budget
        (as many as that takes, or every idle one when even that is not enough)."""
        busy = set(busy)
        excess = self.resident_bytes - self.max_bytes
        out = []
        for key, resident in self._models.items():
            if excess <= 0:
                break
            if key in busy:
                continue
            out.append(key)
            excess -= resident.nbytes
        return out

    def expired(self, busy: Iterable[Hashable]) -> list[Any]:
        """The idle models whose keep-alive has run out."""
        busy = set(busy)
        now = self._clock()
        return [
            key
            for key, resident in self._models.items()
            if key not in busy
            and resident.keep_alive >= 0
            and now - resident.used >= resident.keep_alive
        ]

    def next_expiry(self, busy: Iterable[Hashable]) -> float | None:
        """Seconds until the next idle model's keep-alive runs out (None: none will)."""
        busy = set(busy)
        now = self._clock()
        waits = [
            resident.used + resident.keep_alive - now
            for key, resident in self._models.items()
            if key not in busy and resident.keep_alive >= 0
        ]
        return max(0.0, min(waits)) if waits else None
