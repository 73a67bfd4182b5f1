"""Responses: creating one (a task that generates it), reading it, its input items, cancelling
and deleting it (LMSP B5).

The coroutines here are what the handlers call: their transactions run off the IOLoop
(`ServiceContext.offload`), and what acts on the loop (publishing the committed events, handing
the task to the runner) happens after the commit.
"""

from __future__ import annotations

import json
import secrets
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..auth.scopes import Caller
from ..protocol.errors import LMSPError, invalid, not_found, unauthenticated
from ..protocol.ids import new_id
from ..protocol.objects import input_item, response_object
from ..protocol.responses import CreateResponseRequest, InputItemList, ResponseDeleted
from ..protocol.states import TERMINAL_STATES, TaskState
from ..store import queries, rules
from ..store.tables import Model, Response, Task
from . import metrics
from .admission import Plan
from .context import ServiceContext
from .conversation import conversation_of, input_messages_of, prompt_messages
from .follow import TaskEventStream
from .idempotency import KeyedRequest


def stored_request(request: CreateResponseRequest, seed: int) -> dict[str, Any]:
    """What the response object echoes back, and what the task needs to run again (its
    conversation is stored beside, see `services.conversation`)."""
    return {
        "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens,
        "temperature": 1.0 if request.temperature is None else request.temperature,
        "top_p": 1.0 if request.top_p is None else request.top_p,
        "seed": seed,
        "stream": bool(request.stream),
        "background": bool(request.background),
        "metadata": request.metadata or {},
    }


async def create_response(
    ctx: ServiceContext,
    request: CreateResponseRequest,
    caller: Caller,
    keyed: KeyedRequest | None = None,
    location_prefix: str = "",
    input_param: str = "input",
) -> dict[str, Any]:
    """Commit the response and its task (queued), hand the task to the runner, and return the
    response object as committed. The caller may answer 202 as soon as this returns.

    Before that, admission (`services.admission`): the prompt is counted and must fit the
    model's context window (400 `context_length_exceeded`, naming `input_param`), the output
    limit is capped at what the window leaves, and a paired client must be within its quotas
    (429), checked in the transaction that creates the task.

    With an idempotency key, its result is written in the same transaction: the 202 body for a
    background response that is not streamed, otherwise a link to the response (a repeat gets
    its final form, or its events again).

    The conversation (earlier turns and this input) is stored once, in the response's
    `request`; the task's `params` hold only how to generate.
    """
    model, context = await ctx.offload(_model_and_context, ctx, request, caller)
    conversation = context + request.messages()
    plan = await ctx.admission.plan(
        model,
        prompt_messages(request.instructions, conversation),
        request.max_output_tokens,
        input_param,
    )
    admit = ctx.admission.quota(
        caller, plan.budget, "max_tokens" if input_param == "messages" else "max_output_tokens"
    )
    committed, body = await ctx.offload(
        _commit_response,
        ctx,
        request,
        caller,
        keyed,
        location_prefix,
        _Admitted(model, conversation, plan, admit),
    )
    metrics.task_created("response", committed.task.model)
    ctx.runner.publish(committed)
    ctx.runner.submit(committed.task.id, caller.id)
    return body


@dataclass
class _Admitted:
    """What admission decided for a new response: its model, conversation and plan, and the
    quota check its transaction runs."""

    model: Model
    conversation: list[dict[str, str]]
    plan: Plan
    admit: Callable[[sqlite3.Cursor], None] | None


def _model_and_context(
    ctx: ServiceContext, request: CreateResponseRequest, caller: Caller
) -> tuple[Model, list[dict[str, str]]]:
    return (
        ctx.catalog.resolve(request.model),
        _context_before(ctx, request.previous_response_id, caller),
    )


def _commit_response(
    ctx: ServiceContext,
    request: CreateResponseRequest,
    caller: Caller,
    keyed: KeyedRequest | None,
    location_prefix: str,
    admitted: _Admitted,
) -> tuple[rules.Committed, dict[str, Any]]:
    now = time.time()
    response_id = new_id("resp")
    task_id = new_id("task")
    # Every response has a seed, so every run (a resumed one too) is reproducible.
    seed = request.seed if request.seed is not None else secrets.randbits(31)
    echoed = stored_request(request, seed)
    stored = {
        **echoed,
        "conversation": admitted.conversation,
        "input_count": len(request.messages()),
    }
    response = Response(
        id=response_id,
        task_id=task_id,
        owner=caller.id,
        model=admitted.model.id,
        request=json.dumps(stored),
        previous_response_id=request.previous_response_id,
        store=request.stored,
        created_at=now,
    )
    task = Task(
        id=task_id,
        kind="response",
        state=TaskState.QUEUED,
        on_restart=request.restart_policy,
        owner=caller.id,
        model=admitted.model.id,
        response_id=response_id,
        # Held by this server's runner from the transaction that creates it (LMSP B12).
        runner_id=ctx.runner.runner_id,
        params=json.dumps(
            {
                "max_tokens": admitted.plan.max_tokens,
                "temperature": echoed["temperature"],
                "top_p": echoed["top_p"],
                "seed": seed,
                "prompt_tokens": admitted.plan.prompt_tokens,
                # What the task holds of its caller's quota while unfinished.
                "budget": admitted.plan.budget,
            }
        ),
        created_at=now,
        updated_at=now,
    )
    record = None
    if keyed is not None:
        if request.background and not request.stream:
            body = response_object(response, task)
            record = keyed.result(
                202, body, {"Location": f"{location_prefix}/responses/{response_id}"}
            )
        else:
            record = keyed.result(None, response_id=response_id)
    committed = rules.create_task(ctx.db, task, response, idempotency=record, admit=admitted.admit)
    return committed, response_object(response, committed.task)


def _context_before(
    ctx: ServiceContext, previous_response_id: str | None, caller: Caller
) -> list[dict[str, str]]:
    """The conversation a follow-up turn continues: the earlier turns' messages and answers."""
    if previous_response_id is None:
        return []
    found = queries.get_response(ctx.db, previous_response_id)
    if found is None or not caller.can_see(found[0].owner):
        raise not_found("response", previous_response_id, param="previous_response_id")
    response, task = found
    if TaskState(task.state) not in TERMINAL_STATES:
        raise invalid(
            f"The response '{previous_response_id}' has not finished yet.",
            param="previous_response_id",
            code="previous_response_not_finished",
        )
    context = conversation_of(response, task)
    answer = "".join(
        part.get("text", "")
        for item in json.loads(response.output)
        for part in item.get("content", [])
    )
    context.append({"role": "assistant", "content": answer})
    return context


def _find(ctx: ServiceContext, response_id: str, caller: Caller) -> tuple[Response, Task]:
    """The response and its task, if this caller may see them (others' are simply absent)."""
    found = queries.get_response(ctx.db, response_id)
    if found is None or not caller.can_see(found[0].owner):
        raise not_found("response", response_id)
    return found


def get_response(ctx: ServiceContext, response_id: str, caller: Caller) -> dict[str, Any]:
    return response_object(*_find(ctx, response_id, caller))


def replay_state(ctx: ServiceContext, response_id: str, caller: Caller) -> tuple[bool, bool, bool]:
    """For a repeated keyed create: (finished, streamed, background) of the first one's
    response."""
    response, task = _find(ctx, response_id, caller)
    request = json.loads(response.request)
    return (
        TaskState(task.state) in TERMINAL_STATES,
        bool(request.get("stream")),
        bool(request.get("background")),
    )


async def cancel_response(ctx: ServiceContext, response_id: str, caller: Caller) -> dict[str, Any]:
    _, task = await ctx.offload(_find, ctx, response_id, caller)
    committed = await ctx.offload(rules.request_cancel, ctx.db, task.id)
    ctx.runner.cancelled(committed)
    assert committed.response is not None
    return response_object(committed.response, committed.task)


def delete_response(ctx: ServiceContext, response_id: str, caller: Caller) -> dict[str, Any]:
    """Delete a finished response with its task and events; an unfinished one must be
    cancelled first (its task may not be deleted while unfinished, section 11.2)."""
    _, task = _find(ctx, response_id, caller)
    if not rules.delete_finished_task(ctx.db, task.id):
        raise LMSPError(
            400,
            "response_not_finished",
            f"The response '{response_id}' is still {task.state}; cancel it before deleting it.",
        )
    return ResponseDeleted(id=response_id).wire()


def list_input_items(
    ctx: ServiceContext,
    response_id: str,
    caller: Caller,
    *,
    after: str | None = None,
    limit: int = 20,
    order: str = "desc",
) -> dict[str, Any]:
    response, task = _find(ctx, response_id, caller)
    messages = input_messages_of(response, task)
    items = [input_item(response.id, i, m) for i, m in enumerate(messages)]
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise invalid(f"No input item '{after}' in this response.", param="after")
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    return InputItemList.model_validate(
        {
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit,
        }
    ).wire()


async def response_events(
    ctx: ServiceContext, response_id: str, caller: Caller, after: int = -1
) -> TaskEventStream:
    _, task = await ctx.offload(_find, ctx, response_id, caller)
    return TaskEventStream(
        ctx.db, ctx.bus, task.id, after, idle=ctx.keepalive_interval, caller=caller.id
    )


async def wait_for_response(
    ctx: ServiceContext, response_id: str, caller: Caller
) -> dict[str, Any]:
    """The finished response object, once its task reached a terminal state."""
    events = await response_events(ctx, response_id, caller)
    try:
        async for _ in events:
            pass
    finally:
        await events.aclose()
    if events.revoked:
        raise unauthenticated("The access token was revoked.")
    return await ctx.offload(get_response, ctx, response_id, caller)
