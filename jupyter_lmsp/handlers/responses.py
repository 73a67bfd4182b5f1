"""`/lmsp/v1/responses`: create (plain, streamed, background), retrieve, stream, cancel."""

from __future__ import annotations

from ..protocol.requests import parse_response_request
from ..services import responses
from .base import LMSPHandler, allow_unauthenticated


class ResponsesHandler(LMSPHandler):
    @allow_unauthenticated
    async def post(self) -> None:
        request = parse_response_request(self.json_body())
        response = responses.create_response(self.ctx, request, self.caller)
        if request.background:
            # create_response returned only after the task's transaction committed.
            self.set_header("Location", self.reverse_url_or_path(response["id"]))
            self.write_json(response, status=202)
        elif request.stream:
            await self.write_sse(responses.response_events(self.ctx, response["id"]))
        else:
            self.write_json(await responses.wait_for_response(self.ctx, response["id"]))

    def reverse_url_or_path(self, response_id: str) -> str:
        return f"{self.base_url.rstrip('/')}/lmsp/v1/responses/{response_id}"


class ResponseHandler(LMSPHandler):
    @allow_unauthenticated
    async def get(self, response_id: str) -> None:
        if self.flag_argument("stream"):
            after = self.int_argument("starting_after", -1)
            await self.write_sse(responses.response_events(self.ctx, response_id, after))
        else:
            self.write_json(responses.get_response(self.ctx, response_id))


class ResponseCancelHandler(LMSPHandler):
    @allow_unauthenticated
    def post(self, response_id: str) -> None:
        self.write_json(responses.cancel_response(self.ctx, response_id))
