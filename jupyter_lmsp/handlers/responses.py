"""`/lmsp/v1/responses`: create (plain, streamed, background), retrieve, stream, cancel,
delete, and list input items."""

from __future__ import annotations

from .. import failpoints
from ..protocol.errors import conflict
from ..protocol.requests import parse_response_request
from ..services import responses
from ..store.tables import IdempotencyKey
from .base import LMSPHandler, allow_unauthenticated, idempotent, requires


class ResponsesHandler(LMSPHandler):
    @allow_unauthenticated
    @requires("responses:write")
    @idempotent
    async def post(self) -> None:
        request = parse_response_request(self.json_body())
        response = await responses.create_response(
            self.ctx, request, self.caller, self.keyed, self.api_prefix
        )
        failpoints.hit("after_create_commit")
        if request.background:
            # create_response returned only after the task's transaction committed.
            self.set_header("Location", f"{self.api_prefix}/responses/{response['id']}")
            self.write_json(response, status=202)
        elif request.stream:
            await self.write_sse(responses.response_events(self.ctx, response["id"], self.caller))
        else:
            final = await responses.wait_for_response(self.ctx, response["id"], self.caller)
            self.write_json(final)

    async def replay_response_result(self, row: IdempotencyKey) -> None:
        """A repeated plain or streamed create: the first request's response, once finished."""
        assert row.response_id is not None
        if not responses.is_finished(self.ctx, row.response_id, self.caller):
            raise conflict(
                "idempotency_key_in_use",
                "The response started with this 'Idempotency-Key' is still being generated.",
                retry_after=1,
            )
        if responses.was_streamed(self.ctx, row.response_id, self.caller):
            await self.write_sse(responses.response_events(self.ctx, row.response_id, self.caller))
        else:
            self.write_json(responses.get_response(self.ctx, row.response_id, self.caller))


class ResponseHandler(LMSPHandler):
    @allow_unauthenticated
    @requires("responses:read")
    async def get(self, response_id: str) -> None:
        if self.flag_argument("stream"):
            after = self.int_argument("starting_after", -1)
            await self.write_sse(
                responses.response_events(self.ctx, response_id, self.caller, after)
            )
        else:
            self.write_json(responses.get_response(self.ctx, response_id, self.caller))

    @allow_unauthenticated
    @requires("responses:write")
    def delete(self, response_id: str) -> None:
        self.write_json(responses.delete_response(self.ctx, response_id, self.caller))


class ResponseCancelHandler(LMSPHandler):
    @allow_unauthenticated
    @requires("responses:write")
    @idempotent
    def post(self, response_id: str) -> None:
        self.write_json(responses.cancel_response(self.ctx, response_id, self.caller))


class ResponseInputItemsHandler(LMSPHandler):
    @allow_unauthenticated
    @requires("responses:read")
    def get(self, response_id: str) -> None:
        self.write_json(
            responses.list_input_items(
                self.ctx,
                response_id,
                self.caller,
                after=self.get_query_argument("after", None),
                limit=self.int_argument("limit", 20),
                order=self.get_query_argument("order", "desc"),
            )
        )
