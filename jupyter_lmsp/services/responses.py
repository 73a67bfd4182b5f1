"""Responses: creating one (a task that generates it), reading it, cancelling it (LMSP B5)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from ..protocol.errors import not_found
from ..protocol.ids import new_id
from ..protocol.objects import response_object
from ..protocol.requests import ResponseRequest
from ..protocol.states import TaskState
from ..store import queries, rules
from ..store.tables import Response, Task
from .context import ServiceContext
from .follow import follow_events


def create_response(ctx: ServiceContext, request: ResponseRequest, owner: str) -> dict[str, Any]:
    """Commit the response and its task (queued), hand the task to the runner, and return the
    response object as committed. The caller may answer 202 as soon as this returns."""
    model = ctx.catalog.resolve(request.model)
    now = time.time()
    response_id = new_id("resp")
    task_id = new_id("task")
    messages = list(request.messages)
    if request.instructions:
        messages.insert(0, {"role": "system", "content": request.instructions})
    response = Response(
        id=response_id,
        task_id=task_id,
        owner=owner,
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
        owner=owner,
        model=model.id,
        response_id=response_id,
        params=json.dumps(
            {
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
    committed = rules.create_task(ctx.db, task, response)
    ctx.runner.publish(committed)
    ctx.runner.submit(task_id)
    return response_object(response, committed.task)


def get_response(ctx: ServiceContext, response_id: str) -> dict[str, Any]:
    found = queries.get_response(ctx.db, response_id)
    if found is None:
        raise not_found("response", response_id)
    return response_object(*found)


def cancel_response(ctx: ServiceContext, response_id: str) -> dict[str, Any]:
    found = queries.get_response(ctx.db, response_id)
    if found is None:
        raise not_found("response", response_id)
    committed = ctx.runner.cancel(found[1].id)
    assert committed.response is not None
    return response_object(committed.response, committed.task)


def response_events(
    ctx: ServiceContext, response_id: str, after: int = -1
) -> AsyncIterator[dict[str, Any] | None]:
    found = queries.get_response(ctx.db, response_id)
    if found is None:
        raise not_found("response", response_id)
    return follow_events(ctx.db, ctx.bus, found[1].id, after, idle=ctx.keepalive_interval)


async def wait_for_response(ctx: ServiceContext, response_id: str) -> dict[str, Any]:
    """The finished response object, once its task reached a terminal state."""
    async for _ in response_events(ctx, response_id):
        pass
    return get_response(ctx, response_id)
