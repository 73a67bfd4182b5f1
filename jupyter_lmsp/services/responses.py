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
from .follow import TaskEventStream
from .idempotency import KeyedRequest


def create_response(
    ctx: ServiceContext,
    request: ResponseRequest,
    caller: Caller,
    keyed: KeyedRequest | None = None,
    location_prefix: str = "",
) -> dict[str, Any]:
    """Commit the response and its task (queued), hand the task to the runner, and return the
    response object as committed. The caller may answer 202 as soon as this returns.

    With an idempotency key, its result is written in the same transaction: the 202 body for a
    background response, otherwise a link to the response whose final form is the result.
    """
    model = ctx.catalog.resolve(request.model)
    context = _context_before(ctx, request.previous_response_id, caller)
    now = time.time()
    response_id = new_id("resp")
    task_id = new_id("task")
    turn = context + list(request.messages)
    messages = list(turn)
    if request.instructions:
        messages.insert(0, {"role": "system", "content": request.instructions})
    response = Response(
        id=response_id,
        task_id=task_id,
        owner=caller.id,
        model=model.id,
        request=json.dumps(request.stored_request()),
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
                "input_messages": request.messages,
                "context": turn,
                "messages": messages,
                "max_tokens": request.max_output_tokens or ctx.max_output_tokens_default,
                "temperature": request.temperature,
                "top_p": request.top_p,
                "seed": request.seed,
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
    committed = rules.create_task(ctx.db, task, response, idempotency=record)
    ctx.runner.publish(committed)
    ctx.runner.submit(task_id)
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
