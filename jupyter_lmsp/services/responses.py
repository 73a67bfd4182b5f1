"""Responses: creating one (a task that generates it), reading it, its input items, cancelling
and deleting it (LMSP B5)."""

from __future__ import annotations

import json
import time
from typing import Any

from ..auth.scopes import Caller
from ..protocol.errors import LMSPError, invalid, not_found, unauthenticated
from ..protocol.ids import new_id
from ..protocol.objects import input_item, response_object
from ..protocol.requests import ResponseRequest
from ..protocol.states import TERMINAL_STATES, TaskState
from ..store import queries, rules
from ..store.tables import Response, Task
from .context import ServiceContext
from .conversation import conversation_of, input_messages_of, prompt_messages
from .follow import TaskEventStream
from .idempotency import KeyedRequest


async def create_response(
    ctx: ServiceContext,
    request: ResponseRequest,
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
    background response, otherwise a link to the response whose final form is the result.

    The conversation (earlier turns and this input) is stored once, in the response's
    `request`; the task's `params` hold only how to generate.
    """
    model = ctx.catalog.resolve(request.model)
    context = _context_before(ctx, request.previous_response_id, caller)
    conversation = context + list(request.messages)
    plan = await ctx.admission.plan(
        model,
        prompt_messages(request.instructions, conversation),
        request.max_output_tokens,
        input_param,
    )
    admit = ctx.admission.quota(
        caller, plan.budget, "max_tokens" if input_param == "messages" else "max_output_tokens"
    )
    now = time.time()
    response_id = new_id("resp")
    task_id = new_id("task")
    stored = request.stored_request()
    stored.pop("input", None)
    stored["conversation"] = conversation
    stored["input_count"] = len(request.messages)
    response = Response(
        id=response_id,
        task_id=task_id,
        owner=caller.id,
        model=model.id,
        request=json.dumps(stored),
        previous_response_id=request.previous_response_id,
        store=request.store,
        created_at=now,
    )
    task = Task(
        id=task_id,
        kind="response",
        state=TaskState.QUEUED,
        on_restart=request.on_restart,
        owner=caller.id,
        model=model.id,
        response_id=response_id,
        params=json.dumps(
            {
                "max_tokens": plan.max_tokens,
                "temperature": request.temperature,
                "top_p": request.top_p,
                "seed": request.seed,
                "prompt_tokens": plan.prompt_tokens,
                # What the task holds of its caller's quota while unfinished.
                "budget": plan.budget,
            }
        ),
        created_at=now,
        updated_at=now,
    )
    record = None
    if keyed is not None:
        if request.background:
            task.state = TaskState.QUEUED
            body = response_object(response, task)
            record = keyed.result(
                202, body, {"Location": f"{location_prefix}/responses/{response_id}"}
            )
        else:
            record = keyed.result(None, response_id=response_id)
    committed = rules.create_task(ctx.db, task, response, idempotency=record, admit=admit)
    ctx.runner.publish(committed)
    ctx.runner.submit(task_id, caller.id)
    return response_object(response, committed.task)


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


def is_finished(ctx: ServiceContext, response_id: str, caller: Caller) -> bool:
    return TaskState(_find(ctx, response_id, caller)[1].state) in TERMINAL_STATES


def was_streamed(ctx: ServiceContext, response_id: str, caller: Caller) -> bool:
    return bool(json.loads(_find(ctx, response_id, caller)[0].request).get("stream"))


def cancel_response(ctx: ServiceContext, response_id: str, caller: Caller) -> dict[str, Any]:
    _, task = _find(ctx, response_id, caller)
    committed = ctx.runner.cancel(task.id)
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
    return {"id": response_id, "object": "response.deleted", "deleted": True}


def list_input_items(
    ctx: ServiceContext,
    response_id: str,
    caller: Caller,
    *,
    after: str | None = None,
    limit: int = 20,
    order: str = "desc",
) -> dict[str, Any]:
    if not 1 <= limit <= 100:
        raise invalid("'limit' must be between 1 and 100.", param="limit")
    if order not in ("asc", "desc"):
        raise invalid("'order' must be 'asc' or 'desc'.", param="order")
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
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > limit,
    }


def response_events(
    ctx: ServiceContext, response_id: str, caller: Caller, after: int = -1
) -> TaskEventStream:
    _, task = _find(ctx, response_id, caller)
    return TaskEventStream(
        ctx.db, ctx.bus, task.id, after, idle=ctx.keepalive_interval, caller=caller.id
    )


async def wait_for_response(
    ctx: ServiceContext, response_id: str, caller: Caller
) -> dict[str, Any]:
    """The finished response object, once its task reached a terminal state."""
    events = response_events(ctx, response_id, caller)
    async for _ in events:
        pass
    if events.revoked:
        raise unauthenticated("The access token was revoked.")
    return get_response(ctx, response_id, caller)
