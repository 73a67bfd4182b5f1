"""`/lmsp/v1/tasks`: list, retrieve, cancel, and the event log (JSON page or SSE)."""

from __future__ import annotations

from ..protocol.errors import invalid
from ..services import tasks
from .base import LMSPHandler, allow_unauthenticated, idempotent, requires


class TasksHandler(LMSPHandler):
    @allow_unauthenticated
    @requires("tasks:read")
    def get(self) -> None:
        states = [s for s in self.get_query_arguments("state") for s in s.split(",") if s]
        self.write_json(
            tasks.list_tasks(
                self.ctx,
                self.caller,
                states=states or None,
                kind=self.get_query_argument("kind", None),
                after=self.get_query_argument("after", None),
                limit=self.int_argument("limit", 20),
            )
        )


class TaskHandler(LMSPHandler):
    @allow_unauthenticated
    @requires("tasks:read")
    def get(self, task_id: str) -> None:
        self.write_json(tasks.get_task(self.ctx, task_id, self.caller))


class TaskCancelHandler(LMSPHandler):
    @allow_unauthenticated
    @requires("tasks:write")
    @idempotent
    def post(self, task_id: str) -> None:
        self.write_json(tasks.cancel_task(self.ctx, task_id, self.caller))


class TaskEventsHandler(LMSPHandler):
    @allow_unauthenticated
    @requires("tasks:read")
    async def get(self, task_id: str) -> None:
        wants_stream = self.flag_argument(
            "stream"
        ) or "text/event-stream" in self.request.headers.get("Accept", "")
        if wants_stream:
            after = self._resume_point()
            await self.write_sse(tasks.task_events(self.ctx, task_id, self.caller, after))
        else:
            after = self.int_argument("after", -1)
            limit = self.int_argument("limit", 100)
            self.write_json(tasks.event_page(self.ctx, task_id, self.caller, after, limit))

    def _resume_point(self) -> int:
        """`Last-Event-ID` (an SSE reconnect) wins over `starting_after` / `after`."""
        last_id = self.request.headers.get("Last-Event-ID")
        if last_id is not None:
            try:
                return int(last_id)
            except ValueError:
                raise invalid(
                    "'Last-Event-ID' must be an integer.", param="Last-Event-ID"
                ) from None
        return self.int_argument("starting_after", self.int_argument("after", -1))
