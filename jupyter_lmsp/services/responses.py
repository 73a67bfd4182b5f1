"""Responses: creating one (a task that generates it), reading it, its input items, cancelling
and deleting it (LMSP B5).

The coroutines here are what the handlers call: their transactions run off the IOLoop
(`ServiceContext.offload`), and what acts on the loop (publishing the committed events, handing
the task to the runner) happens after the commit.
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

from ..auth.scopes import Caller
from ..protocol.errors import LMSPError, invalid, not_found
from ..protocol.ids import new_id
from ..protocol.objects import input_item, response_object
from ..protocol.responses import CreateResponseRequest, InputItemList, ResponseDeleted
from ..protocol.states import TERMINAL_STATES, TaskState
from ..store import queries, rules
from ..store.tables import Response, Task
from .context import ServiceContext
from .follow import TaskEventStream
from .idempotency import KeyedRequest


def stored_request(request: CreateResponseRequest, seed: int) -> dict[str, Any]:
    """What the response object echoes back, and what the task needs to run again."""
    return {
        "input": request.raw_input(),
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
) -> dict[str, Any]:
    """Commit the response and its task (queued), hand the task to the runner, and return the
    response object as committed. The caller may answer 202 as soon as this returns.

    With an idempotency key, its result is written in the same transaction: the 202 body for a
    background response that is not streamed, otherwise a link to the response (a repeat gets
    its final form, or its events again).
    """
    committed, body = await ctx.offload(
        _commit_response, ctx, request, caller, keyed, location_prefix
    )
    ctx.runner.publish(committed)
    ctx.runner.submit(committed.task.id)
    return body


def _commit_response(
    ctx: ServiceContext,
    request: CreateResponseRequest,
    caller: Caller,
    keyed: KeyedRequest | None,
    location_prefix: str,
) -> tuple[rules.Committed, dict[str, Any]]:
    model = ctx.catalog.resolve(request.model)
    context = _context_before(ctx, request.previous_response_id, caller)
    now = time.time()
    response_id = new_id("resp")
    task_id = new_id("task")
    # Every response has a seed, so every run (a resumed one too) is reproducible.
    seed = request.seed if request.seed is not None else secrets.randbits(31)
    echoed = stored_request(request, seed)
    input_messages = request.messages()
    turn = context + input_messages
    messages = list(turn)
    if request.instructions:
        messages.insert(0, {"role": "system", "content": request.instructions})
    response = Response(
        id=response_id,
        task_id=task_id,
        owner=caller.id,
        model=model.id,
        request=json.dumps(echoed),
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
        model=model.id,
        response_id=response_id,
        params=json.dumps(
            {
                "input_messages": input_messages,
                "context": turn,
                "messages": messages,
                "max_tokens": request.max_output_tokens or ctx.max_output_tokens_default,
                "temperature": echoed["temperature"],
                "top_p": echoed["top_p"],
                "seed": seed,
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
    committed = rules.create_task(ctx.db, task, response, idempotency=record)
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
    params = json.loads(task.params)
    context = list(params.get("context", params.get("messages", [])))
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
    messages = json.loads(task.params).get("input_messages", [])
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
    return TaskEventStream(ctx.db, ctx.bus, task.id, after, idle=ctx.keepalive_interval)


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
    return await ctx.offload(get_response, ctx, response_id, caller)
