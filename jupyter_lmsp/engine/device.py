"""Which device the worker's models run on, for the choices that differ between a GPU and the
CPU backend (how much evaluating a graph early costs, whether `mx.async_eval` overlaps)."""

from __future__ import annotations

import functools


@functools.cache
def on_gpu() -> bool:
    """Whether the model runs on a GPU (the worker never changes its device)."""
    import mlx.core as mx

    return bool(mx.default_device() == mx.gpu)
