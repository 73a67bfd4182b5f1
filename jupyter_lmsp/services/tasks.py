"""Tasks: listing, reading, cancelling, and reading or following a task's event log (LMSP B6).

A paired client sees only the tasks it created; anyone else's are absent (404), never
forbidden, so their existence does not leak.
"""

from __future__ import annotations

from typing import Any

from ..auth.scopes import Caller
from ..protocol.errors import not_found
from ..protocol.objects import task_object
from ..protocol.tasks import TaskList
from ..store import queries, rules
from ..store.tables import Task
from .context import ServiceContext
from .follow import TaskEventStream


def list_tasks(
    ctx: ServiceContext,
    caller: Caller,
    *,
    states: list[str] | None = None,
    kind: str | None = None,
    after: str | None = None,
    limit: int = 20,
) -> dict[str, Any]:
    page = queries.list_tasks(
        ctx.db, states=states, kind=kind, owners=caller.owner_filter, after=after, limit=limit
    )
    summaries = queries.response_summaries(
        ctx.db, [t.response_id for t in page.tasks if t.response_id]
    )
    data = [task_object(t, summaries.get(t.response_id or "")) for t in page.tasks]
    return TaskList.model_validate(
        {
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": page.has_more,
        }
    ).wire()


def _find(ctx: ServiceContext, task_id: str, caller: Caller) -> Task:
    task = queries.get_task(ctx.db, task_id)
    if task is None or not caller.can_see(task.owner):
        raise not_found("task", task_id)
    return task


def _summarised(ctx: ServiceContext, task: Task) -> dict[str, Any]:
    """The task object with what tells it apart (its response's prompt, outcome, tokens)."""
    summaries = queries.response_summaries(ctx.db, [task.response_id] if task.response_id else [])
    return task_object(task, summaries.get(task.response_id or ""))


def get_task(ctx: ServiceContext, task_id: str, caller: Caller) -> dict[str, Any]:
    return _summarised(ctx, _find(ctx, task_id, caller))


async def cancel_task(ctx: ServiceContext, task_id: str, caller: Caller) -> dict[str, Any]:
    await ctx.offload(_find, ctx, task_id, caller)
    committed = await ctx.offload(rules.request_cancel, ctx.db, task_id)
    ctx.runner.cancelled(committed)
    return await ctx.offload(_summarised, ctx, committed.task)


def event_page(
    ctx: ServiceContext, task_id: str, caller: Caller, after: int, limit: int
) -> dict[str, Any]:
    _find(ctx, task_id, caller)
    events = queries.list_events(ctx.db, task_id, after, limit + 1)
    # Assembled, not re-validated: the events are as committed (tests check them against
    # the Event schema).
    return {
        "object": "list",
        "data": events[:limit],
        "has_more": len(events) > limit,
        "last_sequence_number": events[:limit][-1]["sequence_number"] if events else after,
    }


async def task_events(
    ctx: ServiceContext, task_id: str, caller: Caller, after: int = -1
) -> TaskEventStream:
    await ctx.offload(_find, ctx, task_id, caller)
    return TaskEventStream(
        ctx.db,
        ctx.bus,
        task_id,
        after,
        idle=ctx.keepalive_interval,
        caller=caller.id,
        offload=ctx.offload,
    )
