"""`truncation: "auto"` on `POST /responses`: a prompt that does not fit the context window
loses its oldest messages until it does.

What may go: the messages before the latest turn (earlier turns from `previous_response_id`
or a conversation, and those given in `input` itself), oldest first, a turn at a time — a cut
is made only before a user message, so a tool result never loses its call. What never goes:
the instructions, system messages (instructions given as messages), and the latest turn (from
the last user message on). When even the latest turn alone does not
fit, the request is refused as with `truncation: "disabled"` (`400 context_length_exceeded`).
The fewest turns that make it fit are dropped (a binary search over the cuts, counting each
candidate with the model's tokenizer as admission does). The response says what was dropped:
`truncation_details` (how many messages, the prompt's tokens before). The response stores
the conversation it was given, so its `input_items` and a later turn see what the model saw.
"""

from __future__ import annotations

from typing import Any

from ..protocol.errors import LMSPError
from ..store.tables import Model
from .admission import Plan
from .context import ServiceContext
from .conversation import prompt_messages
from .response_spec import ResponseSpec


async def fit(
    ctx: ServiceContext, model: Model, spec: ResponseSpec, context: list[dict[str, Any]]
) -> tuple[Plan, list[dict[str, Any]], list[dict[str, Any]]]:
    """The plan of a response (`Admission.plan`), the conversation it is given (earlier turns,
    then its input) and the part of it that is its input. With `truncation: "auto"` and a
    prompt too long, the oldest messages are left out and `spec.echo["truncation_details"]`
    says so; `400 context_length_exceeded` when nothing that may go makes it fit."""
    everything = context + spec.messages
    try:
        return await _plan(ctx, model, spec, everything), everything, spec.messages
    except LMSPError as e:
        if e.code != "context_length_exceeded" or spec.truncation != "auto":
            raise
        refused = e
    users = [i for i, m in enumerate(everything) if m["role"] == "user"]
    # The latest turn starts at the last user message; a cut is made before a user message.
    cuts = users[1:] if users and users[0] == 0 else users
    found: tuple[Plan, list[int]] | None = None
    low, high = 0, len(cuts) - 1
    while low <= high:
        middle = (low + high) // 2
        kept = _kept(everything, cuts[middle])
        try:
            plan = await _plan(ctx, model, spec, [everything[i] for i in kept])
        except LMSPError as e:
            if e.code != "context_length_exceeded":
                raise
            low = middle + 1
            continue
        found = (plan, kept)
        high = middle - 1
    if found is None:
        raise refused
    plan, kept = found
    before = await ctx.admission.count(
        model,
        prompt_messages(spec.instructions, everything),
        spec.generation.engine_tools(),
        effort=spec.generation.effort,
        effort_param=spec.generation.effort_param,
    )
    spec.echo["truncation_details"] = {
        "type": "auto",
        "dropped_messages": len(everything) - len(kept),
        "input_tokens_before": before or 0,
    }
    conversation = [everything[i] for i in kept]
    # Kept in order, so the input's messages still there are the conversation's last ones.
    input_count = sum(1 for i in kept if i >= len(context))
    return plan, conversation, conversation[len(conversation) - input_count :]


def _kept(messages: list[dict[str, Any]], cut: int) -> list[int]:
    """The indices of the messages kept when those before `cut` go, system messages excepted."""
    return [i for i in range(cut) if messages[i]["role"] == "system"] + list(
        range(cut, len(messages))
    )


async def _plan(
    ctx: ServiceContext, model: Model, spec: ResponseSpec, messages: list[dict[str, Any]]
) -> Plan:
    """`Admission.plan` for the response with `messages` (earlier turns and input)."""
    return await ctx.admission.plan(
        model,
        prompt_messages(spec.instructions, messages),
        spec.max_output_tokens,
        spec.input_param,
        tools=spec.generation.engine_tools(),
        choices=spec.generation.n,
        effort=spec.generation.effort,
        effort_param=spec.generation.effort_param,
    )
