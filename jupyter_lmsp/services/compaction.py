"""Compacting a conversation (`POST /responses/compact`): its user messages kept as they were,
everything else replaced by one `compaction` item sealing a summary the model writes; and
counting a conversation's prompt tokens (`POST /responses/input_tokens`).

The compaction pass is an ordinary response, run as a task like any other (admission, quotas,
the runner, durability while it runs), that is not stored: its rows go once its summary is
read. Its prompt is the conversation written out as a transcript, under instructions to
summarise it; a conversation too long for the model's window loses its oldest turns from the
transcript until the prompt leaves room for the summary (the user messages are kept whole in
the output all the same). Greedy, so the same conversation compacts to the same summary.
"""

from __future__ import annotations

import time
from typing import Any

from ..auth.scopes import Caller
from ..protocol.compaction import (
    CompactedResponse,
    CompactedUserMessage,
    CompactionItem,
    CompactResponseRequest,
    InputTokenCount,
    InputTokensRequest,
)
from ..protocol.errors import LMSPError, conflict
from ..protocol.ids import new_id
from ..protocol.response_object import InputText
from ..store.tables import Model
from .context import ServiceContext
from .conversation import prompt_messages
from .generation import Generation
from .response_spec import ResponseSpec
from .responses import context_before, create_response, discard_unstored, wait_for_response
from .summaries import KIND, SUMMARY_PREFIX, is_summary, open_compactions

INSTRUCTIONS = (
    "You compact conversations. Summarise the conversation below so that it can be continued "
    "from your summary alone: the user's goals and constraints, what was done and decided, the "
    "tools called and what they returned, the results, and what is still open. Be concise and "
    "exact; keep names, numbers, file paths and code that later turns will need. Write only "
    "the summary."
)


def transcript(messages: list[dict[str, Any]]) -> list[str]:
    """The conversation as lines of text, one turn each, for the summarising model."""
    lines = []
    for m in messages:
        role, content = m.get("role"), str(m.get("content") or "")
        if is_summary(m):
            lines.append("Summary of still earlier turns: " + content[len(SUMMARY_PREFIX) :])
        elif role == "system":
            lines.append("Instructions: " + content)
        elif role == "tool":
            lines.append(f"Tool result ({m.get('tool_call_id')}): {content}")
        elif role == "assistant":
            if content:
                lines.append("Assistant: " + content)
            for call in m.get("tool_calls") or []:
                given = call["input"] if "input" in call else call["arguments"]
                lines.append(f"Assistant called {call['name']}({given}) [{call['id']}]")
        else:
            lines.append("User: " + content)
    return lines


def _prompt(lines: list[str]) -> list[dict[str, Any]]:
    text = "Conversation:\n\n" + "\n\n".join(lines) + "\n\nWrite the summary now."
    return [{"role": "user", "content": text}]


async def _fitted(ctx: ServiceContext, model: Model, lines: list[str]) -> tuple[list[str], int]:
    """The transcript's newest lines whose prompt leaves room for the summary, and the
    summary's output limit."""
    window = ctx.admission.window(model)
    most = ctx.compaction_summary_tokens
    limit = most if window is None else max(1, min(most, window // 4))
    if window is None:
        return lines, limit
    while len(lines) > 1:
        counted = await ctx.admission.count(model, prompt_messages(INSTRUCTIONS, _prompt(lines)))
        if counted is None or counted + limit <= window:
            break
        lines = lines[max(1, len(lines) // 8) :]
    return lines, limit


async def compact(
    ctx: ServiceContext, request: CompactResponseRequest, caller: Caller
) -> dict[str, Any]:
    messages = open_compactions(ctx.sealer, request.messages())
    model = await ctx.offload(ctx.catalog.resolve, request.model)
    context = await ctx.offload(context_before, ctx, request.previous_response_id, caller)
    conversation = context + messages
    lines, limit = await _fitted(ctx, model, transcript(conversation))
    spec = ResponseSpec(
        messages=_prompt(lines),
        model=model.id,
        instructions=INSTRUCTIONS,
        max_output_tokens=limit,
        temperature=0,
        store=False,
        # The summary waits in the queue as the request asked.
        service_tier=request.service_tier if request.service_tier in ("priority", "flex") else None,
        cache_key=request.prompt_cache_key,
    )
    created = await create_response(ctx, spec, caller)
    try:
        final = await wait_for_response(ctx, created["id"], caller)
    finally:
        await discard_unstored(ctx, created)
    if final["status"] == "cancelled":
        raise conflict("response_cancelled", "The compaction was cancelled.")
    if final["status"] == "failed":
        error = final.get("error") or {}
        raise LMSPError(
            500,
            str(error.get("code") or "server_error"),
            "The compaction pass failed: " + str(error.get("message") or "no summary"),
            type="server_error",
        )
    summary = "".join(
        part.get("text", "")
        for item in final["output"]
        if item.get("type") == "message"
        for part in item.get("content", [])
    ).strip()
    assert ctx.sealer is not None
    sealed = ctx.sealer.seal(
        KIND, {"summary": summary, "model": model.id, "created_at": int(time.time())}
    )
    kept = [m for m in conversation if m.get("role") == "user" and not is_summary(m)]
    output: list[CompactedUserMessage | CompactionItem] = [
        CompactedUserMessage(id=new_id("msg"), content=[InputText(text=str(m["content"]))])
        for m in kept
    ]
    output.append(CompactionItem(id=new_id("cmp"), encrypted_content=sealed))
    return CompactedResponse(
        id=final["id"], created_at=final["created_at"], output=output, usage=final["usage"]
    ).wire()


async def count_input_tokens(
    ctx: ServiceContext, request: InputTokensRequest, caller: Caller
) -> dict[str, Any]:
    """What `POST /responses/input_tokens` answers: the prompt the request describes, with the
    turns before `previous_response_id`, its instructions and its tools rendered by the model's
    template, counted as admission counts a create's."""
    messages = open_compactions(ctx.sealer, request.messages())
    model = await ctx.offload(ctx.catalog.resolve, request.model)
    context = await ctx.offload(context_before, ctx, request.previous_response_id, caller)
    tools = Generation(tools=request.as_create_request().tools_spec()).engine_tools()
    prompt = prompt_messages(request.instructions, context + messages)
    counted = await ctx.admission.count(model, prompt, tools, strict=True)
    assert counted is not None
    return InputTokenCount(input_tokens=counted).wire()
