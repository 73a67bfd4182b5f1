"""The engine side of reasoning (issue 37): effort, a thinking budget, and grammars that apply
after the thinking block.

- **Effort** (`effort_args`): Responses' `reasoning.effort`, Chat Completions'
  `reasoning_effort`, as the chat template's switch. For a model with thinking markers (mlx-lm's
  `TokenizerWrapper.has_thinking`), "none" and "minimal" render the prompt with
  `enable_thinking=False` and the others with `enable_thinking=True` (mlx-lm hands it to the
  template under the model's own name, `thinking` for some: `_infer_thinking_kwarg`). A template
  that reads `reasoning_effort` (gpt-oss's) also gets the level, as it knows them: "low",
  "medium" or "high" ("none" and "minimal" as "low", "xhigh" as "high"). A model with neither
  cannot reason apart from its answer: any effort but "none"/"minimal" is refused
  (`EffortRefused`, which names what it can take). The server checks it at request time with
  the tokenizer it counts prompts with (`engine.tokens`), the worker again at the job.
- **Budget** (`ThinkingBudget`): once a choice has written `limit` tokens inside its thinking
  block (the markers are not counted), every token but the end marker's next one is masked, so
  the block closes and the answer follows. A logits processor of the choice, fed the resumed
  tokens first, so a resumed choice closes its block where the uninterrupted one did.
- **Grammars after thinking** (`after_thinking`): a job's grammar (structured output, forced
  or strict tool calls) wrapped so the model may think first: the thinking block (the start
  marker, unless the prompt opened it; any text; the end marker), then the grammar, which
  llguidance keeps as a grammar of its own (`@answer`) that the wrapper refers to. Markers are
  written as token references (`<[id]>`), so they are exactly the tokens mlx-lm recognises.

Pure apart from `ThinkingBudget.__call__` (MLX, imported there) and the llguidance compiler.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from .thinking import Thinking

if TYPE_CHECKING:
    import mlx.core as mx

# The efforts OpenAI's APIs name, least first.
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
# Those that turn thinking off (a model that cannot think takes only these).
NO_THINKING = ("none", "minimal")
# gpt-oss's levels for each effort.
_LEVELS = {
    "none": "low",
    "minimal": "low",
    "low": "low",
    "medium": "medium",
    "high": "high",
    "xhigh": "high",
}


class EffortRefused(ValueError):
    """The model cannot take this effort; `allowed` are the efforts it can."""

    def __init__(self, effort: str, allowed: Sequence[str]) -> None:
        self.effort = effort
        self.allowed = tuple(allowed)
        super().__init__(
            f"this model does not reason apart from its answer (no thinking markers, and its "
            f"chat template has no reasoning_effort), so it cannot take effort {effort!r}; "
            f"it takes {' or '.join(repr(a) for a in self.allowed)} (or none given)"
        )


def template_text(tokenizer: Any) -> str:
    """The model's chat template(s) as text ("" when it has none it can show)."""
    found = getattr(tokenizer, "chat_template", None)
    if isinstance(found, dict):
        return "\n".join(str(t) for t in found.values())
    if isinstance(found, list):  # [{"name", "template"}] in some tokenizer configs
        return "\n".join(str(t.get("template", "")) for t in found if isinstance(t, dict))
    return found if isinstance(found, str) else ""


def allowed_efforts(tokenizer: Any) -> tuple[str, ...]:
    """The efforts a model can take."""
    if getattr(tokenizer, "has_thinking", False) or "reasoning_effort" in template_text(tokenizer):
        return EFFORTS
    return NO_THINKING


def effort_args(tokenizer: Any, effort: str | None) -> dict[str, Any]:
    """The chat template's arguments for `effort` (none: {}); raises `EffortRefused` for an
    effort the model cannot take, ValueError for one no API names."""
    if effort is None:
        return {}
    if effort not in EFFORTS:
        raise ValueError(f"unknown reasoning effort {effort!r}; one of {', '.join(EFFORTS)}")
    allowed = allowed_efforts(tokenizer)
    if effort not in allowed:
        raise EffortRefused(effort, allowed)
    args: dict[str, Any] = {}
    if getattr(tokenizer, "has_thinking", False):
        args["enable_thinking"] = effort not in NO_THINKING
    if "reasoning_effort" in template_text(tokenizer):
        args["reasoning_effort"] = _LEVELS[effort]
    return args


# --- the budget -----------------------------------------------------------------------------

_BEFORE, _IN, _AFTER = 0, 1, 2


class ThinkingBudget:
    """One choice's thinking budget, as an mlx-lm logits processor: after `limit` tokens inside
    the block, the end marker is forced, token by token. `resumed`: the tokens the choice
    generated before a resume (fed first, so the count goes on from them).

    Each call is one decoding step: the first call's input is the context's last token (the
    prompt's, or the last resumed one, already fed), every later call's the token sampled at
    the step before (`context[-1]`, read back: the mask depends on it).
    """

    def __init__(self, thinking: Thinking, limit: int, resumed: Sequence[int] = ()) -> None:
        self._start, self._end = thinking.start_ids, thinking.end_ids
        self.limit = max(0, int(limit))
        self._state = _IN if thinking.open else _BEFORE
        self._pending: list[int] = []
        self._tail: list[int] = []
        # Tokens written inside the block (markers left out), and how much of the end marker
        # has been forced (None: not forcing).
        self.inside = 0
        self._forcing: int | None = None
        self._started = False
        for token in resumed:
            self._feed(token)

    @property
    def closed(self) -> bool:
        """Whether the block is over (or never began)."""
        return self._state == _AFTER

    def _feed(self, token: int) -> None:
        if self._state == _BEFORE:
            self._pending.append(token)
            if tuple(self._pending) == self._start:
                self._state, self._pending = _IN, []
            elif tuple(self._pending) != self._start[: len(self._pending)]:
                self._state, self._pending = _AFTER, []
        elif self._state == _IN:
            if self._forcing is not None:
                self._forcing += 1
                if self._forcing >= len(self._end):
                    self._state = _AFTER
                return
            self.inside += 1
            self._tail = [*self._tail, token][-len(self._end) :]
            if tuple(self._tail) == self._end:
                self._state = _AFTER

    def next_forced(self) -> int | None:
        """The token the budget forces next (None: any)."""
        if self._state != _IN:
            return None
        if self._forcing is None and self.inside >= self.limit:
            self._forcing = 0
        return None if self._forcing is None else self._end[self._forcing]

    def __call__(self, context: mx.array, logits: mx.array) -> mx.array:
        import mlx.core as mx

        if self._started and self._state != _AFTER:
            self._feed(cast(int, context[-1].item()))  # a token id: an int32 scalar
        self._started = True
        token = self.next_forced()
        if token is None:
            return logits
        keep = mx.arange(logits.shape[-1]) == token
        return mx.where(keep, logits, mx.array(-mx.inf, logits.dtype))


def make_budget(
    thinking: Thinking | None, limit: int | None, resumed: Sequence[int] = ()
) -> ThinkingBudget | None:
    """The budget processor of a choice, or None (no limit, or a model that does not think)."""
    if thinking is None or limit is None:
        return None
    return ThinkingBudget(thinking, limit, resumed)


# --- grammars after thinking ----------------------------------------------------------------


def after_thinking(grammar: str, thinking: Thinking) -> str:
    """`grammar` (llguidance's JSON form, as `grammars.build_grammar` makes it) wrapped so the
    thinking block comes first and the grammar constrains only what follows it."""
    try:
        whole = json.loads(grammar)
    except ValueError:  # Lark text (`grammar_from_lark` gives it back as such)
        whole = {"grammars": [{"lark_grammar": grammar}]}
    parts = list(whole["grammars"])
    answer = dict(parts[0])
    name = answer.get("name") or "answer"
    answer["name"] = name
    start = " ".join(f"<[{t}]>" for t in thinking.start_ids)
    end = " ".join(f"<[{t}]>" for t in thinking.end_ids)
    # The markers are token references: exactly the tokens mlx-lm matches (a special token,
    # or a run of tokens, as Gemma's multi-token markers). The block's text is any text; it
    # ends where the end marker's tokens come (the same bytes spelled by other tokens are text).
    lines = ["%llguidance {}", "THOUGHT: /(?s:.*)/", "GAP: /[ \\t\\r\\n]{1,4}/"]
    if thinking.open:
        lines.append(f"start: THOUGHT {end} GAP? @{name}")
    else:
        lines.append(f"think: {start} THOUGHT {end} GAP?")
        lines.append(f"start: think? @{name}")
    main = {"lark_grammar": "\n".join(lines)}
    return json.dumps({**whole, "grammars": [main, answer, *parts[1:]]})
