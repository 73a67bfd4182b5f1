"""`/lmsp/v1/responses`: create (plain, streamed, background, background and streamed),
retrieve, stream, cancel, delete, and list input items."""

from __future__ import annotations

import asyncio
from typing import Any

from .. import failpoints
from ..protocol.compaction import (
    CompactedResponse,
    CompactResponseRequest,
    InputTokenCount,
    InputTokensRequest,
)
from ..protocol.errors import conflict
from ..protocol.events import Event
from ..protocol.operations import EventStream, Reply, ResponseHeader
from ..protocol.response_object import InputItemList, Response, ResponseDeleted
from ..protocol.responses import CreateResponseRequest, InputItemsQuery, RetrieveResponseQuery
from ..services import compaction, responses
from .base import LMSPHandler, operation
from .websocket import ResponsesSocket

EVENTS = EventStream(
    "EventStreamItem",
    (Event,),
    description="One server-sent event of a task's log: `id` is its sequence number, `event` "
    "its type, `data` the Event as JSON. Keep-alives are `:` comment lines.",
)


class ResponsesHandler(ResponsesSocket):
    """POST creates a response; a GET that asks to upgrade opens the WebSocket mode
    (handlers.websocket)."""

    # The response this request created, while its client's leaving would stop it
    # (`responses.abandoned_with_its_client`): set until the answer is complete.
    abandonable: dict[str, Any] | None = None

    @operation(
        "createResponse",
        "Create a response (plain, streamed, or in the background)",
        "responses",
        access="responses:write",
        replies={
            200: Reply(
                "The finished response, or with `stream: true` its task's events from sequence "
                "0 as SSE (`id`, `event`, `data` lines; every `data` has `type` and "
                "`sequence_number`). With `background` too, the task goes on if the client "
                "leaves and can be followed again with `starting_after`.",
                Response,
                stream=EVENTS,
            ),
            202: Reply(
                "With `background: true` (and no `stream`): the queued response, committed "
                "before this answer.",
                Response,
                headers={"Location": ResponseHeader("The response's URL.")},
            ),
        },
        errors=(404, 429),
        idempotent=True,
    )
    async def post(self, body: CreateResponseRequest) -> None:
        response = await responses.create_response(
            self.ctx, body, self.caller, self.keyed, self.api_prefix
        )
        failpoints.hit("after_create_commit")
        if responses.abandoned_with_its_client(body):
            self.abandonable = response
        if body.stream:
            # From sequence 0, as for any stream; a background task goes on if the client
            # leaves, and `GET /responses/{id}?stream=true&starting_after=N` resumes it.
            complete = await self.write_sse(
                await responses.response_events(self.ctx, response["id"], self.caller, created=True)
            )
            if not complete:
                await self._abandon()
                return
        elif body.background:
            # create_response returned only after the task's transaction committed.
            self.set_header("Location", f"{self.api_prefix}/responses/{response['id']}")
            self.write_json(response, status=202)
        else:
            self.write_json(
                await responses.wait_for_response(self.ctx, response["id"], self.caller)
            )
        self.abandonable = None
        # A response that is not stored is gone once its request has it.
        await responses.discard_unstored(self.ctx, response)

    def on_connection_close(self) -> None:
        # Seen at once, even while no event is being written (a stream idle between tokens, a
        # plain answer still awaited): the write that would fail may be seconds away.
        super().on_connection_close()
        if self.abandonable is not None:
            asyncio.get_running_loop().create_task(self._abandon())

    async def _abandon(self) -> None:
        """The client went away before its answer was complete: stop the response (once)."""
        response, self.abandonable = self.abandonable, None
        if response is not None:
            await responses.abandon(self.ctx, response)

    async def replay_response_result(self, response_id: str, parsed: Any) -> None:
        """A repeated streamed or plain create: the first request's events, or its response
        once finished."""
        finished, streamed, background = await self.call(
            responses.replay_state, self.ctx, response_id, self.caller
        )
        if streamed and (finished or background):
            await self.write_sse(
                await responses.response_events(self.ctx, response_id, self.caller, created=True)
            )
        elif finished:
            self.write_json(
                await self.call(
                    responses.get_response, self.ctx, response_id, self.caller, created=True
                )
            )
        else:
            raise conflict(
                "idempotency_key_in_use",
                "The response started with this 'Idempotency-Key' is still being generated.",
                retry_after=1,
            )


class ResponseHandler(LMSPHandler):
    @operation(
        "getResponse",
        "Retrieve a response, or stream its events",
        "responses",
        access="responses:read",
        replies={
            200: Reply(
                "The response, or with `stream=true` its events as SSE.", Response, stream=EVENTS
            )
        },
        errors=(404,),
    )
    async def get(self, response_id: str, query: RetrieveResponseQuery) -> None:
        if query.stream:
            await self.write_sse(
                await responses.response_events(
                    self.ctx, response_id, self.caller, query.starting_after
                )
            )
        else:
            self.write_json(
                await self.call(responses.get_response, self.ctx, response_id, self.caller)
            )

    @operation(
        "deleteResponse",
        "Delete a finished response with its task and events",
        "responses",
        access="responses:write",
        replies={200: Reply("Deleted.", ResponseDeleted)},
        errors=(400, 404),
    )
    async def delete(self, response_id: str) -> None:
        self.write_json(
            await self.call(responses.delete_response, self.ctx, response_id, self.caller)
        )


class ResponseCancelHandler(LMSPHandler):
    @operation(
        "cancelResponse",
        "Cancel a response's task (a finished one is returned unchanged)",
        "responses",
        access="responses:write",
        replies={200: Reply("The response after the cancel request.", Response)},
        errors=(404,),
        idempotent=True,
    )
    async def post(self, response_id: str) -> None:
        self.write_json(await responses.cancel_response(self.ctx, response_id, self.caller))


class ResponseInputItemsHandler(LMSPHandler):
    @operation(
        "listInputItems",
        "The input messages of a response",
        "responses",
        access="responses:read",
        replies={200: Reply("A page of input items.", InputItemList)},
        errors=(404,),
    )
    async def get(self, response_id: str, query: InputItemsQuery) -> None:
        self.write_json(
            await self.call(
                responses.list_input_items,
                self.ctx,
                response_id,
                self.caller,
                after=query.after,
                limit=query.limit,
                order=query.order,
            )
        )


class ResponseCompactHandler(LMSPHandler):
    @operation(
        "compactResponse",
        "Compact a conversation: its user messages and one sealed summary of the rest",
        "responses",
        access="responses:write",
        replies={
            200: Reply(
                "The compacted conversation: every user message as it was, then one "
                "`compaction` item (send them back as `input` to continue).",
                CompactedResponse,
            )
        },
        errors=(404, 409, 429),
        idempotent=True,
        description="The summary is written by the model, as a response that is not stored "
        "(its usage is the compaction pass's). A compaction item sent back in `input` is "
        "opened into its summary; one this service did not seal, or altered, is a 400.",
    )
    async def post(self, body: CompactResponseRequest) -> None:
        self.write_json(await compaction.compact(self.ctx, body, self.caller))


class ResponseInputTokensHandler(LMSPHandler):
    @operation(
        "countInputTokens",
        "Count the prompt tokens a response would be given",
        "responses",
        access="responses:write",
        replies={200: Reply("The prompt's token count.", InputTokenCount)},
        errors=(404,),
        description="The input, the turns before `previous_response_id`, the instructions and "
        "the tools, rendered by the model's chat template and counted with its tokenizer, as "
        "`POST /responses` counts them against the context window. Nothing is run or stored.",
    )
    async def post(self, body: InputTokensRequest) -> None:
        self.write_json(await compaction.count_input_tokens(self.ctx, body, self.caller))
