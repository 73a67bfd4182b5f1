"""Presence and frequency penalties (OpenAI's `presence_penalty`, `frequency_penalty`) as a
choice's logits processor.

OpenAI's formula, applied to each step's logits before sampling:

    logits[t] -= frequency_penalty * count(t) + presence_penalty * (count(t) > 0)

where count(t) is how often the choice has *generated* token t so far. The prompt does not count
(earlier turns of a conversation, the system prompt): OpenAI penalizes the sampled tokens only.

Why not mlx-lm's `make_presence_penalty` / `make_frequency_penalty`: they count the last
`context_size` (default 20) tokens of the row's whole token context, prompt included, so they
would penalize the prompt's tokens and forget generated tokens past a window; and the context
they are given is not the same in every decoder (the batch's holds the prompt and everything
after it, `generate_step`'s only the part of the prompt not yet prefilled). So `Penalties`
keeps its own counts.

Resuming: a job resumed after a crash re-prefills its prompt and the tokens it had already
generated; those were generated, so the counts start from them (`resumed`). The first call then
sees exactly the counts the uninterrupted run had at that position, and a resumed run draws the
tokens the uninterrupted one drew.

Each call is one decoding step of the choice (the processor goes wherever the row goes, as a
grammar's `constraints.Constraint` does): the first call's input is the context's last token
(the prompt's, or the last resumed token, already counted); every later call's input, the last
token of its `context`, is the token sampled at the step before, which is counted then. The
counts stay an MLX array, updated lazily, so the step is never waited for here (mlx-lm computes
the next step before the tokens of this one are read).

Rows with penalties never speculate (`spec_batch` speculates only for rows whose processors are
none or one grammar): a verify step would need the counts after each draft token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import mlx.core as mx

# OpenAI's range for both.
PENALTY_LIMIT = 2.0


class Penalties:
    """One choice's presence and frequency penalties, as an mlx-lm logits processor (see the
    module docstring). `resumed`: the tokens the choice generated before a resume."""

    def __init__(self, presence: float, frequency: float, resumed: Sequence[int] = ()) -> None:
        self.presence = float(presence)
        self.frequency = float(frequency)
        self._resumed = list(resumed)
        self._counts: mx.array | None = None
        self._started = False

    def __call__(self, context: mx.array, logits: mx.array) -> mx.array:
        import mlx.core as mx

        if self._counts is None:
            counts = mx.zeros((logits.shape[-1],), dtype=mx.float32)
            if self._resumed:
                counts = counts.at[mx.array(self._resumed, dtype=mx.int32)].add(1.0)
            self._counts = counts
        if self._started:
            # The token sampled at the previous step (an int32 scalar, maybe not yet computed).
            self._counts = self._counts.at[context[-1:].astype(mx.int32)].add(1.0)
        self._started = True
        shift = self.frequency * self._counts + self.presence * (self._counts > 0)
        return logits - shift.astype(logits.dtype)


def make_penalties(
    presence: float, frequency: float, resumed: Sequence[int] = ()
) -> Penalties | None:
    """The processor for these penalties, or None when both are 0 (nothing to apply)."""
    if not presence and not frequency:
        return None
    return Penalties(presence, frequency, resumed)
