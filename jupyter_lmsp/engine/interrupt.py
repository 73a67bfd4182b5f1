"""Abandoning a forward pass part-way: checkpoints between a model's layers.

MLX cannot stop an evaluation once it has begun, and on the CPU backend one forward pass is
long: ~150-200 ms for a decode step of the 135M demo model on two cores, ~2 s for a 128-token
prefill chunk, far more for larger models. A cancel that arrives during such a pass would
otherwise wait for all of it before its slot can go to the next task.

`install_checkpoints(model, checkpoints)` gives a few of the model's layers (those that end
each of `SECTIONS` equal parts of the stack, the last excepted) a check after their output:
when `Checkpoints.ask` is set (and the pass is long enough), the output computed so far is
evaluated and `ask()` says whether to go on; if not, `StepAbandoned` is raised out of the
model call, and the caller (the worker) drops the step's batch (`BatchScheduler.abandon`).
Without `ask` the layers run as before: the same lazy graph, nothing evaluated early.

Evaluating part of a pass early costs a little: the graph of the layers after a checkpoint is
built only once the layers before it are computed, instead of while they are. So the worker
asks only when abandoning can help (see `worker.Worker._checkpoints_for_step`).

The layers keep their parameters and their class's behaviour: each becomes an instance of a
subclass of its own class that only adds the check, so weights, `parameters()` and the
model's own forward code are untouched.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import mlx.nn as nn

# A pass is checked at the end of each third of the layer stack (the last excepted): a cancel
# then waits for at most about a third of a pass.
SECTIONS = 3


class StepAbandoned(Exception):
    """Raised from inside a model's forward pass when `Checkpoints.ask` says to stop."""


@dataclass
class Checkpoints:
    """What a model's checkpointed layers ask between sections of a pass.

    `ask()` returns True to abandon the pass; `None` means no check. Only passes of at least
    `min_positions` positions per row are checked (1: every pass, decode steps included;
    prefill chunks and verify steps have more): the others are not evaluated early.
    """

    ask: Callable[[], bool] | None = None
    min_positions: int = 1


_SUBCLASSES: dict[type, type] = {}


def _checkpointed(cls: type) -> type:
    sub = _SUBCLASSES.get(cls)
    if sub is None:

        def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
            out = cls.__call__(self, *args, **kwargs)
            checkpoints = self._lmsp_checkpoints
            ask = checkpoints.ask
            if ask is not None and _positions(out) >= checkpoints.min_positions:
                import mlx.core as mx

                mx.eval(out)
                if ask():
                    raise StepAbandoned
            return out

        sub = type(f"Checkpointed{cls.__name__}", (cls,), {"__call__": __call__})
        _SUBCLASSES[cls] = sub
    return sub


def _positions(out: Any) -> int:
    """Positions per row of a layer's output (hidden states are batch × positions × dims)."""
    first = out[0] if isinstance(out, tuple | list) else out
    shape: tuple[int, ...] = tuple(getattr(first, "shape", ()))
    return int(shape[1]) if len(shape) >= 2 else 1


def checkpoint_layers(count: int, sections: int = SECTIONS) -> list[int]:
    """Indices of the layers that end each of `sections` equal parts of `count` layers,
    the last part excepted (its end is the end of the pass)."""
    ends = {round(count * k / sections) - 1 for k in range(1, sections)}
    return sorted(i for i in ends if 0 <= i < count - 1)


def install_checkpoints(model: nn.Module, checkpoints: Checkpoints) -> int:
    """Give `model`'s checkpoint layers a check against `checkpoints`; returns how many.

    A model without a `layers` list (mlx-lm's models all have one) gets none: its passes run
    to their end. Installing again only points the layers at the new `checkpoints`.
    """
    layers = getattr(model, "layers", None)
    if not isinstance(layers, list | tuple) or len(layers) < 2:
        return 0
    chosen = checkpoint_layers(len(layers))
    for i in chosen:
        layer = layers[i]
        base = type(layer)
        if base in _SUBCLASSES.values():
            base = base.__mro__[1]
        layer.__class__ = _checkpointed(base)
        # A plain attribute (not an array or module): not a parameter of the model.
        object.__setattr__(layer, "_lmsp_checkpoints", checkpoints)
    return len(chosen)
