"""Cost-sized prefill chunks: a long prompt's chunks cost about the same all the way through.

A model's batch step (`batching._BatchDecoder.next`) is one decode step of the running rows,
then one chunk of every prompt being prefilled, so a running row waits one chunk per step. A
chunk of n tokens read after c positions already in the KV cache costs

    cost(n, c) ~ fixed + a * (n * (1 + (c + n / 2) / K) + c / S)

- a part that grows with n: the projections and MLP, every weight times n positions;
- a part that grows with n times the context each token attends to (c + n / 2 positions on
  average, the chunk's own triangle included); `K` (`break_even`) is the context at which
  attention costs a token as much as everything else does;
- a part that grows with the context alone, once per pass whatever n: the KV cache and its
  keys are copied and laid out for the attention; `S` (`pass_span`) is the context whose
  per-pass cost is one token's at no context;
- a fixed part (every weight read once: about a decode step).

With a fixed n the cost grows without bound as the prompt is read: on the demo model on one
CPU thread a 128-token chunk took ~0.5 s of CPU at the start of a prompt and ~4.1 s after
6,000 tokens, and the other rows' streams paused that long.

So while other rows are decoding, a chunk gets as many tokens as keep its cost at the
*designed* chunk's, a `step`-token chunk at the start of a prompt: n solves
n * (K + c + n / 2) + K * c / S = step * (K + step / 2) (the fixed part is on both sides and
drops out), so n shrinks roughly like step * K / (K + c). A prompt alone in the batch (no row
decoding beside it) is read in full `step`-token chunks: smaller ones would only make it
slower, with no one to be fair to.

`K` and `S` were measured for the demo model (SmolLM2-135M, float32) on the CPU with OpenBLAS,
one thread, in CPU time (the machine was shared): chunks of 1 to 128 tokens at contexts 0 to
6,000 fitted K between 790 and 930 and S about 150 (`DEFAULT_BREAK_EVEN`, `DEFAULT_PASS_SPAN`);
the chunks this sizes then cost 0.54-0.55 s predicted against 0.515 s measured for the designed
one. In the worker, beside a decoding row, they cost within ~15% of each other along a 6,000-token
prompt (dearest between 1,000 and 3,000 positions). On the CPU the attention's FLOPs are ~5x less efficient than the weights' matmuls
(softmax and masks over every position): a count of FLOPs alone would put K near 3,900. Other
models and devices have other constants; these are the defaults. A chunk never goes below
`MIN_CHUNK` tokens: a pass is then mostly its fixed and per-pass parts and the prompt would
take many times longer. So past about 8,000 positions with the defaults, chunks cost more than the designed one, growing with the context again.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable

# The context (positions in the KV cache) at which attention costs a prompt token as much as
# the rest of the model does; measured for the demo model on the CPU (see the docstring).
DEFAULT_BREAK_EVEN = 850
# The context whose once-per-pass cost equals one prompt token's at no context (ditto).
DEFAULT_PASS_SPAN = 150
# The fewest tokens a cost-sized chunk takes (see the docstring).
MIN_CHUNK = 8


def chunk_cost(
    tokens: int, context: int, break_even: int, pass_span: int = DEFAULT_PASS_SPAN
) -> float:
    """A chunk's cost without its fixed part: `tokens` read after `context` cached positions,
    in units of one token's cost at no context, times `break_even`."""
    return tokens * (break_even + context + tokens / 2) + break_even * context / pass_span


def designed_cost(step: int, break_even: int) -> float:
    """The cost, in the units of `chunk_cost`, of a `step`-token chunk read from position 0."""
    return chunk_cost(step, 0, break_even)


def chunk_tokens(
    context: int,
    step: int,
    break_even: int = DEFAULT_BREAK_EVEN,
    pass_span: int = DEFAULT_PASS_SPAN,
    budget: float = 1.0,
) -> int:
    """Tokens for the next chunk of a prompt with `context` positions already in its cache, so
    the chunk costs about what a `step`-token chunk from position 0 does (at least
    `MIN_CHUNK`, at most `step`). `budget` scales that cost (`ChunkPacer`'s correction)."""
    if step <= MIN_CHUNK:
        return step
    context = max(0, context)
    reach = break_even + context
    if budget != 1.0:
        # The same root in floating point: the budget is a measured ratio, not an integer.
        spare = 2 * (budget * designed_cost(step, break_even) - break_even * context / pass_span)
        if spare <= 0:
            return MIN_CHUNK
        return max(MIN_CHUNK, min(step, int(math.sqrt(reach * reach + spare) - reach)))
    # The positive root of n^2 / 2 + reach * n + K * c / S = designed cost, times two (twice
    # the designed cost is an integer; the per-pass part is rounded up: never over budget).
    room = step * (2 * break_even + step) + (-2 * break_even * context) // pass_span
    if room <= 0:
        return MIN_CHUNK
    return max(MIN_CHUNK, min(step, math.isqrt(reach * reach + room) - reach))


class ChunkPacer:
    """Chunk sizes from the cost model, corrected by what the chunks cost when read.

    The constants of `chunk_cost` are one model's on one device; another model, another
    device or another BLAS puts the dearest chunks elsewhere (the demo model's cost-sized
    chunks still cost ~15% more between 1,000 and 3,000 positions than at the start). So
    the pacer measures: the step that reads the first chunk of a prompt (context under
    `step`) beside decoding rows sets the *target* (the median of the last few prompts',
    each scaled to a designed chunk: a decode step plus a designed chunk), and every step that reads a
    whole chunk beside decoding rows moves `budget` (the multiple of the designed cost the
    next chunk is sized for) by the square root of target / measured: half-way, in ratio,
    to the budget that would have made that step cost the target. At the fixed point every
    step costs the target, whatever the model's real curve; the square root damps the noise
    of single measurements. The clock is the worker's CPU time (`time.process_time`), which
    other processes do not stretch. Until a target is measured (a prompt that starts from a
    cached prefix), the model alone sizes the chunks.
    """

    def __init__(
        self,
        step: int,
        break_even: int = DEFAULT_BREAK_EVEN,
        pass_span: int = DEFAULT_PASS_SPAN,
        clock: Callable[[], float] = time.process_time,
        low: float = 0.25,
        high: float = 1.5,
    ) -> None:
        self.step = step
        self.break_even = max(1, break_even)
        self.pass_span = max(1, pass_span)
        self.clock = clock
        self.budget = 1.0
        self._low, self._high = low, high
        self._designed: deque[float] = deque(maxlen=5)

    @property
    def target(self) -> float | None:
        """What a decode step plus a designed chunk costs, once measured (seconds)."""
        return statistics.median(self._designed) if self._designed else None

    def tokens(self, context: int) -> int:
        """The next chunk's tokens for a prompt with `context` positions cached."""
        return chunk_tokens(context, self.step, self.break_even, self.pass_span, self.budget)

    def measured(self, tokens: int, context: int, seconds: float) -> None:
        """A step read `tokens` prompt tokens after `context` cached positions, beside
        decoding rows, and cost `seconds`."""
        if tokens <= 0 or seconds <= 0:
            return
        used = chunk_cost(tokens, context, self.break_even, self.pass_span)
        designed = designed_cost(self.step, self.break_even)
        if context < self.step:
            # A prompt's first chunk: what a designed chunk costs (scaled to one, if the
            # budget had sized this chunk otherwise). Only the first: further in, the cost
            # already depends on the context, as the model may have it wrong.
            self._designed.append(seconds * designed / used)
        target = self.target
        if target is None:
            return
        # The budget that would have made this step cost the target.
        wanted = target / seconds * used / designed
        budget = math.sqrt(self.budget * wanted)
        self.budget = min(self._high, max(self._low, budget))
