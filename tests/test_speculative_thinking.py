"""Speculation over a thinking block and the grammar after it (issue 37): a thinking model's
constrained call comes out token for token the same with every verify step speculated
(`FORCED`) as without speculation, whichever shape its thinking markers have.

Each model is a context model (tests/contextmodel.py) that thinks, then calls `exec_command`
in its family's format, and repeats tokens, so the n-gram drafter proposes across the
markers: one `<think>` / `</think>` pair (single tokens), Gemma's `<|channel>thought` /
`<channel|>` (a two-token start) and Kimi K3's `<|open|>think<|sep|>` / `<|close|>think<|sep|>`
(three tokens each way, `think` a text token). The grammar is the worker's: the family's call
grammar after free thinking (`reasoning.after_thinking`).

The Kimi K3 case failed with `constraint_failed` (the matcher refused the model's own `think`
after `<|close|>`) while llguidance rolled back a verify step's draft across that marker; the
drafts are now masked on a copy of the matcher (`constraints.mask_verify_step`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from contextmodel import make_context_model
from familymodels import chat_template, family_script, thinking_markers
from schedrun import FORCED, Result, collect, job, scheduler
from scriptedmodel import CALL_NAME

from jupyter_lmsp.engine.constraints import ll_tokenizer
from jupyter_lmsp.engine.grammars import FunctionTool, ToolSpec, build_grammar
from jupyter_lmsp.engine.reasoning import after_thinking
from jupyter_lmsp.engine.speculative import OFF
from jupyter_lmsp.engine.thinking import Thinking
from jupyter_lmsp.engine.toolcalls import render
from jupyter_lmsp.engine.worker import call_format_of, encode_chat

pytestmark = pytest.mark.timeout(300)

# One family per shape of thinking markers: single tokens, a two-token start (Gemma's), three
# tokens each way with a text token among them (Kimi K3's).
FAMILIES = ("qwen3_coder", "gemma4", "kimi_k3")
# Thinking that repeats itself, so the drafter has something to propose inside it too.
THINKING = ("I should", " run it", ",", " so", " I should", " run it")


def _model(root: Path, family: str) -> tuple[Any, Any]:
    import mlx_lm

    markers = thinking_markers(family)
    script = family_script(family)
    path = make_context_model(
        root / family,
        (*markers.start, *THINKING, *markers.end, *script.tokens),
        special=(*markers.special, *script.special),
        template=chat_template(family),
        extra_tokens=markers.extra,
    )
    model, tokenizer = mlx_lm.load(str(path))
    assert (tokenizer.think_start, tokenizer.think_end) == markers.text
    return model, tokenizer


def _run(model: Any, tokenizer: Any, family: str, choice: str, speculation: Any) -> Result:
    """One constrained thinking-then-call job through the scheduler, as the worker prepares it."""
    script = family_script(family)
    tools = ToolSpec((FunctionTool(CALL_NAME, "Run a command", script.parameters, True),), choice)
    call_format = call_format_of(tokenizer, ll_tokenizer(family, model, tokenizer), tools)
    messages, template_args = render([{"role": "user", "content": "Run it."}], tools, call_format)
    prompt = encode_chat(tokenizer, messages, **template_args)
    thinking = Thinking.of(tokenizer, prompt)
    assert thinking is not None and not thinking.open
    grammar = build_grammar(None, tools, call_format)
    assert grammar is not None
    sched = scheduler(speculation=speculation)
    results = {("t", 0): Result()}
    _, updates = sched.add(
        job("t", messages=messages, max_tokens=80),
        family,
        model,
        tokenizer,
        prompt,
        after_thinking(grammar, thinking),
        thinking,
    )
    collect(results, updates)
    while sched.active:
        collect(results, sched.step())
    return results[("t", 0)]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_thinking_call_is_the_same_with_every_step_speculated(
    tmp_path: Path, family: str
) -> None:
    model, tokenizer = _model(tmp_path, family)
    markers = thinking_markers(family)
    expected = "".join((*markers.start, *THINKING, *markers.end, *family_script(family).tokens))
    for choice in ("auto", "required"):
        off = _run(model, tokenizer, family, choice, OFF)
        on = _run(model, tokenizer, family, choice, FORCED)
        errors = [u.error for u in on.updates if u.error]
        assert not errors, (choice, errors)
        assert off.text == expected and off.finish_reason == "stop", (choice, off.text)
        assert (on.tokens, on.text, on.finish_reason) == (off.tokens, off.text, "stop"), choice
        # The drafts crossed the markers: verify steps took drafted tokens.
        assert sum(u.drafted for u in on.updates) > 0, choice
