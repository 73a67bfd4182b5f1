"""Grammar-constrained decoding inside the batch: one llguidance matcher per choice.

A `Constraint` belongs to one choice of one job, never to a batch row: rows move as jobs join
and leave the batch, so a per-row matcher would end up fed another job's tokens (the bug of
mlx-vlm issue 1574). It is the choice's logits processor, which mlx-lm's `BatchGenerator`
(and `generate_step`) keeps with the choice's row wherever the row moves, and calls with that
row's logits only: rows without a constraint are never masked or copied.

Each call (one per decoding step of the choice):
1. on a GPU, starts the step's forward pass (`mx.async_eval`), so the CPU mask work below
   overlaps it, as llguidance recommends. Not on the CPU backend: there `async_eval` returns
   only once most of the pass has been computed (measured: after ~115 of ~145 ms on the demo
   model), so it would make the call wait for the pass, and the batch's own `async_eval` of
   the sampled tokens, which then returns earlier, would no longer leave the end of the pass
   to overlap the scheduler's work on the tokens of the step before (constrained rows lost
   ~5% of their tokens per second to that);
2. feeds the matcher the token sampled at the previous step (read back from the row's token
   context; the first call's input is the last token of the prompt, which is not output);
3. computes the matcher's token bitmask and applies it to the row's logits: plain MLX
   operations on the CPU backend (llguidance's `llguidance.mlx` kernel is Metal-only), the
   Metal kernel on macOS.

The grammar is enforced, never dropped: if the matcher fails (an internal error, or a token it
cannot take), `error` is set and every token but EOS is masked; the scheduler then fails the
job with `constraint_failed` before it emits anything past the last valid token. When the
grammar is complete the matcher allows only EOS, so a constrained choice ends there.

Resuming: a fresh matcher is fed the snapshot's tokens (`resumed`), which puts it exactly where
the uninterrupted run's matcher was; nothing about a matcher is ever stored.

Speculative decoding (`spec_batch`): a constrained row speculates like any other, under its
grammar. Before a verify step the batch positions the matcher at the step's first position
(`begin`: it feeds the tokens the last verify step kept, then the step's input), proposes the
grammar's forced tokens (`forced`, llguidance's fast-forward tokens) or else the row's n-gram
proposal cut to its longest prefix the grammar allows (`valid_prefix`), and
`mask_verify_step` computes the mask of every position of every constrained row of the step
in one call (llguidance feeds each draft token by token to a copy of the matcher, which is
then dropped: its rollback is not to be trusted) and applies them in one operation, so each position's token is drawn from exactly the
distribution a step of one token would draw it from there. Proposed tokens the verify keeps
are fed at the next `begin`. Outside verify steps each call feeds one token, as above. Forced
tokens are thus fast-forwarded as drafts: several in one pass, each still checked against the
model's own choice (a forced *byte* sequence may tokenize more than one way).
"""

from __future__ import annotations

import sys
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from jupyter_lmsp.engine.device import on_gpu

if TYPE_CHECKING:
    import llguidance
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.tokenizer_utils import TokenizerWrapper


class ConstraintError(Exception):
    """The grammar cannot be used for this model (it does not compile with its tokenizer)."""


_TOKENIZERS: dict[Hashable, llguidance.LLTokenizer] = {}


_MAX_TOKENIZERS = 4


def ll_tokenizer(
    model_key: Hashable, model: nn.Module, tokenizer: TokenizerWrapper
) -> llguidance.LLTokenizer:
    """llguidance's view of a model's tokenizer, made once per model (~0.5 s for a 49k vocab)."""
    found = _TOKENIZERS.get(model_key)
    if found is not None:
        return found
    import llguidance.hf

    vocab = getattr(getattr(model, "args", None), "vocab_size", None)
    made = llguidance.hf.from_tokenizer(
        tokenizer._tokenizer, n_vocab=vocab, eos_token=sorted(tokenizer.eos_token_ids)
    )
    while len(_TOKENIZERS) >= _MAX_TOKENIZERS:
        del _TOKENIZERS[next(iter(_TOKENIZERS))]
    _TOKENIZERS[model_key] = made
    return made


def forget_tokenizer(model_key: Hashable) -> None:
    _TOKENIZERS.pop(model_key, None)


def parser_limits() -> llguidance.LLParserLimits:
    """llguidance's limits for every matcher this service builds: its defaults, but errors
    without the parser's state and grammar in them (a 159 KB grammar once ended up in a
    task's stored error)."""
    import llguidance

    return llguidance.LLParserLimits(verbose_errors=False)


def compile_grammar(tokenizer: llguidance.LLTokenizer, grammar: str) -> llguidance.LLMatcher:
    """A fresh matcher for `grammar`; raises `ConstraintError` if it does not compile."""
    import llguidance

    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=parser_limits())
    if matcher.is_error():
        raise ConstraintError(matcher.get_error())
    return matcher


class Constraint:
    """One choice's grammar matcher, as an mlx-lm logits processor (see the module docstring).

    `grammar` is llguidance's grammar text, or a fresh matcher of it (`compile_grammar`, whose
    `deep_copy()` gives each choice of a job its own without compiling again). Raises
    `ConstraintError` if the grammar does not compile, or if the resumed tokens do not follow it.
    """

    def __init__(
        self,
        tokenizer: llguidance.LLTokenizer,
        grammar: str | llguidance.LLMatcher,
        resumed: Sequence[int] = (),
    ) -> None:
        if isinstance(grammar, str):
            grammar = compile_grammar(tokenizer, grammar)
        self._matcher = grammar
        if resumed and not self._matcher.consume_tokens(list(resumed)):
            raise ConstraintError(
                f"the resumed tokens do not follow the grammar: {self._matcher.get_error()}"
            )
        self._eos = tokenizer.eos_token
        self._words = (tokenizer.vocab_size + 31) // 32
        self._bitmask = np.zeros((1, self._words), dtype=np.int32)
        self._started = False
        # `begin` has put the matcher at this step's first position: the call feeds nothing.
        self._ready = False
        self.error: str | None = None

    @property
    def accepting(self) -> bool:
        """Whether the text so far is complete under the grammar."""
        return self._matcher.is_accepting()

    def __call__(self, context: mx.array, logits: mx.array) -> mx.array:
        import mlx.core as mx

        if self._ready:
            self._ready = False
        elif self._started:
            if on_gpu():
                # Let the forward pass run while we wait for the last token and build the mask.
                mx.async_eval(logits)
            self._feed(cast(int, context[-1].item()))  # a token id: an int32 scalar
        self._started = True
        self._fill(self._bitmask, 0)
        return apply_bitmask(logits, self._bitmask)

    # --- speculative decoding (spec_batch) -------------------------------------------------

    def begin(self, kept: Sequence[int], last: int) -> None:
        """Put the matcher at the first position of the step about to be queued: feed the
        proposed tokens the last verify step kept, then the step's input `last` (at the first
        call, `last` is the prompt's last token: nothing is fed). The step's call (`__call__`,
        or `mask_verify_step` for a verify step) then feeds nothing."""
        if self._started:
            for token in kept:
                self._feed(token)
            self._feed(last)
        self._started = True
        self._ready = True

    def forced(self, limit: int) -> list[int]:
        """Up to `limit` tokens the grammar forces from here (after `begin`)."""
        if self.error is not None or limit <= 0:
            return []
        return list(self._matcher.compute_ff_tokens()[:limit])

    def valid_prefix(self, draft: Sequence[int]) -> int:
        """How many of `draft`'s first tokens the grammar allows from here (after `begin`)."""
        if self.error is not None or not draft:
            return 0
        return int(self._matcher.validate_tokens(list(draft)))

    # --- the matcher -----------------------------------------------------------------------

    def _feed(self, token: int) -> None:
        if self.error is None and not self._matcher.consume_token(token):
            self.error = self._matcher.get_error() or f"token {token} is not allowed here"

    def _fill(self, bitmask: np.ndarray[Any, Any], index: int) -> None:
        from llguidance.numpy import fill_next_token_bitmask

        if self.error is None:
            try:
                fill_next_token_bitmask(self._matcher, bitmask, index)
            except Exception as exc:  # an API-level failure must not pass unconstrained either
                self.error = f"{type(exc).__name__}: {exc}"
        self._check(bitmask[index : index + 1])

    def _check(self, masks: np.ndarray[Any, Any]) -> None:
        """After the matcher filled `masks` (one per position): record a matcher failure or a
        position that allows nothing as `error`; then every position allows only EOS, so
        nothing unconstrained is ever generated (the job fails on it)."""
        if self.error is None and self._matcher.is_error():
            self.error = self._matcher.get_error()
        if self.error is None and not masks.any(axis=1).all():
            self.error = "the grammar allows no token here"
        if self.error is not None:
            masks[:] = 0
            masks.view(np.uint32)[:, self._eos // 32] = 1 << (self._eos % 32)


_EXECUTOR: llguidance.LLExecutor | None = None


def _executor() -> llguidance.LLExecutor:
    global _EXECUTOR
    if _EXECUTOR is None:
        import llguidance

        _EXECUTOR = llguidance.LLExecutor()
    return _EXECUTOR


def mask_verify_step(
    logits: mx.array, rows: Sequence[tuple[int, Constraint, Sequence[int]]]
) -> mx.array:
    """A verify step's `logits` (rows x positions x vocab) with each listed row's positions 0
    .. len(draft) masked by its grammar: the mask at its first position, then the mask after
    each draft token (fed, then rolled back); other rows and positions as they are.

    Each constraint must have been put at the step's first position (`Constraint.begin`), and
    its draft must be a prefix its grammar allows (`Constraint.valid_prefix`). Every mask of
    the step is computed in one call of llguidance's executor (which drops the GIL), on copies
    of the drafted rows' matchers (the matchers stay at the step's first position), and
    applied in one operation. A matcher that fails gets `error` and allows only EOS.
    """
    import mlx.core as mx
    from llguidance.numpy import (
        fill_next_token_bitmask_par,
        fill_next_token_bitmask_par_with_draft_tokens,
    )

    if not rows:
        return logits
    count, width, vocab = logits.shape
    words = rows[0][1]._words
    bitmask = np.zeros((len(rows) * width, words), dtype=np.int32)
    drafted = []  # llguidance takes rows with and without drafts in separate calls
    alone = []
    for k, (_, constraint, draft) in enumerate(rows):
        constraint._ready = False  # this is the step's call
        if constraint.error is None and draft:
            # A copy takes the draft (2 us after 10 tokens, 50 us after 1,000 on the demo
            # model, against a verify step's tens of ms): llguidance 1.9.1 feeds a draft,
            # computes its masks and rolls it back, and that rollback leaves the parser wrong
            # when the draft holds the second token of a multi-token marker after free text
            # (Kimi K3's `<|close|>think<|sep|>`: the matcher then refused the model's `think`).
            drafted.append((constraint._matcher.deep_copy(), k * width, list(draft)))
        elif constraint.error is None:
            alone.append((constraint._matcher, k * width))
    try:
        if drafted:
            fill_next_token_bitmask_par_with_draft_tokens(_executor(), drafted, bitmask)
        if alone:
            fill_next_token_bitmask_par(_executor(), alone, bitmask)
    except Exception as exc:  # an API-level failure must not pass unconstrained either
        for _, constraint, _ in rows:
            constraint.error = constraint.error or f"{type(exc).__name__}: {exc}"
    allowed = np.ones((count, width, vocab), dtype=np.bool_)
    for k, (row, constraint, draft) in enumerate(rows):
        positions = 1 + len(draft)
        mine = bitmask[k * width : k * width + positions]
        constraint._check(mine)
        allowed[row, :positions] = _allowed(mine, vocab)
    return mx.where(mx.array(allowed), logits, mx.array(-mx.inf, logits.dtype))


def _allowed(bitmask: np.ndarray[Any, Any], vocab: int) -> np.ndarray[Any, Any]:
    """`bitmask` (rows x words) as booleans (rows x `vocab`); tokens past its end (a model
    whose output is wider than its tokenizer) are not allowed."""
    bits = np.unpackbits(bitmask.view(np.uint8), axis=-1, bitorder="little")[:, :vocab]
    if bits.shape[1] < vocab:
        bits = np.pad(bits, ((0, 0), (0, vocab - bits.shape[1])))
    return bits.astype(np.bool_)


def apply_bitmask(logits: mx.array, bitmask: np.ndarray[Any, Any]) -> mx.array:
    """`logits` (rows × vocab) with every token whose bit is 0 in `bitmask` (one row of bits
    per row of logits) set to -inf.

    Plain MLX operations (on the CPU backend); llguidance's Metal kernel on macOS. Tokens past
    the bitmask's end (a model whose output is wider than its tokenizer) are masked.
    """
    import mlx.core as mx

    if sys.platform == "darwin" and mx.metal.is_available():
        from llguidance.mlx import apply_token_bitmask

        vocab = logits.shape[-1]
        words = (vocab + 31) // 32
        mask = bitmask[:, :words]
        if mask.shape[1] < words:
            mask = np.pad(mask, ((0, 0), (0, words - mask.shape[1])))
        return apply_token_bitmask(logits, mask)
    allowed = _allowed(bitmask, logits.shape[-1])
    return mx.where(mx.array(allowed), logits, mx.array(-mx.inf, logits.dtype))
