"""`/lmsp/v1/tasks`: list, retrieve, cancel, and the event log (JSON page or SSE)."""

from __future__ import annotations

from collections.abc import AsyncGenerator

from ..protocol.fields import SequenceNumber
from ..protocol.operations import EventStream, Reply, RequestHeader
from ..protocol.tasks import (
    EventPage,
    LifecycleEvent,
    LifecycleQuery,
    ListTasksQuery,
    Task,
    TaskEventsQuery,
    TaskList,
)
from ..services import tasks
from ..services.lifecycle import LifecycleStream
from .base import LMSPHandler, operation, sse_frame
from .responses import EVENTS

LAST_EVENT_ID = RequestHeader(
    "Last-Event-ID",
    SequenceNumber,
    "An SSE reconnect: resume after this sequence number (wins over the query).",
)


class TasksHandler(LMSPHandler):
    @operation(
        "listTasks",
        "Tasks, newest first",
        "tasks",
        access="tasks:read",
        replies={200: Reply("A page of tasks.", TaskList)},
    )
    async def get(self, query: ListTasksQuery) -> None:
        self.write_json(
            await self.call(
                tasks.list_tasks,
                self.ctx,
                self.caller,
                states=[s.value for s in query.state] if query.state else None,
                kind=query.kind,
                after=query.after,
                limit=query.limit,
            )
        )


class TaskHandler(LMSPHandler):
    @operation(
        "getTask",
        "One task",
        "tasks",
        access="tasks:read",
        replies={200: Reply("The task.", Task)},
        errors=(404,),
    )
    async def get(self, task_id: str) -> None:
        self.write_json(await self.call(tasks.get_task, self.ctx, task_id, self.caller))


class TaskCancelHandler(LMSPHandler):
    @operation(
        "cancelTask",
        "Cancel a task: `queued` ends at once, `loading`/`running` go through `cancelling`",
        "tasks",
        access="tasks:write",
        replies={200: Reply("The task after the cancel request (a finished one unchanged).", Task)},
        errors=(404,),
        idempotent=True,
    )
    async def post(self, task_id: str) -> None:
        self.write_json(await tasks.cancel_task(self.ctx, task_id, self.caller))


class TaskEventsHandler(LMSPHandler):
    @operation(
        "listTaskEvents",
        "A task's event log: a JSON page, or SSE (stored events, then live ones)",
        "tasks",
        access="tasks:read",
        replies={
            200: Reply(
                "A page of events; with `stream=true` (or `Accept: text/event-stream`) SSE "
                "frames `id`, `event`, `data`, with `: keep-alive` comments while idle.",
                EventPage,
                stream=EVENTS,
            )
        },
        errors=(404,),
        headers=(LAST_EVENT_ID,),
    )
    async def get(self, task_id: str, query: TaskEventsQuery, last_event_id: int | None) -> None:
        wants_stream = query.stream or "text/event-stream" in self.request.headers.get("Accept", "")
        if wants_stream:
            # `Last-Event-ID` (an SSE reconnect) wins over `starting_after` / `after`.
            if last_event_id is not None:
                after = last_event_id
            elif query.starting_after is not None:
                after = query.starting_after
            else:
                after = query.after
            await self.write_sse(await tasks.task_events(self.ctx, task_id, self.caller, after))
        else:
            self.write_json(
                await self.call(
                    tasks.event_page, self.ctx, task_id, self.caller, query.after, query.limit
                )
            )


LIFECYCLE = EventStream(
    "LifecycleStreamItem",
    (LifecycleEvent,),
    description="One transition of one of the caller's tasks: `id` is its sequence number "
    "(across all tasks), `event` its type, `data` the LifecycleEvent as JSON. Keep-alives are "
    "`:` comment lines.",
)


class LifecycleHandler(LMSPHandler):
    @operation(
        "followLifecycle",
        "Every task of the caller created, changing state and ending, as SSE",
        "tasks",
        access="tasks:read",
        replies={
            200: Reply(
                "SSE frames `id`, `event`, `data` (a LifecycleEvent), in commit order, until "
                "the client goes away; `: keep-alive` comments while idle.",
                stream=LIFECYCLE,
            )
        },
        headers=(LAST_EVENT_ID,),
        description="A board of tasks lists `/tasks` once, then follows this stream instead "
        "of polling; a reconnect with `Last-Event-ID` misses and repeats nothing.",
    )
    async def get(self, query: LifecycleQuery, last_event_id: int | None) -> None:
        stream = LifecycleStream(
            self.ctx.db,
            self.ctx.bus,
            self.caller,
            self.ctx.offload,
            last_event_id if last_event_id is not None else query.after,
            idle=self.ctx.keepalive_interval,
        )
        await stream.start()

        async def frames() -> AsyncGenerator[str, None]:
            try:
                async for event in stream:
                    yield ": keep-alive\n\n" if event is None else sse_frame(event)
            finally:
                await stream.aclose()

        await self.stream_sse(frames(), lambda: stream.ready)
