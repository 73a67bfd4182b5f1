"""The WebSocket mode of `/responses` (Open Responses; messages in `protocol.websocket`).

A client opens a WebSocket on the URL it POSTs responses to, with the same credentials, and
sends `response.create` messages: each creates a response as `POST /responses` with `stream`
would (admission, quotas, the durable task) and its events come back on the socket as text
messages, each the JSON the SSE stream's `data` carries, from `response.created` to the
terminal event. Messages are handled one at a time, in order, so a client may chain turns with
`previous_response_id` without waiting in between. A message that cannot be acted on gets an
`error` message with the HTTP status it would have had; the socket stays open.

Durability is the SSE streams': a stored response goes on when its socket closes, and a new
socket continues it with `response.follow` after the last sequence number received (or
`GET /responses/{id}?stream=true&starting_after=N`). A response that is not stored stops when
its socket closes, as a streamed one does when its client leaves: nobody else could read it.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from jupyter_server.base.handlers import JupyterHandler
from tornado.websocket import WebSocketClosedError, WebSocketHandler

from ..protocol.errors import LMSPError, invalid
from ..protocol.responses import CreateResponseRequest
from ..protocol.validation import validate
from ..protocol.websocket import HTTP_ONLY_FIELDS, WebSocketError, WebSocketFollow
from ..services import responses
from ..services.follow import TaskEventStream
from .base import LMSPHandler

log = logging.getLogger(__name__)


class ResponsesSocket(WebSocketHandler, LMSPHandler):
    """The base of the `/responses` handler: an LMSP handler (its POST creates responses) whose
    GET, asking to upgrade, becomes this socket once `prepare` authenticated the caller."""

    websocket_get = True
    _messages: asyncio.Queue[str | None] | None = None
    _server: asyncio.Task[None] | None = None
    # The unstored response being streamed, stopped if the socket closes (set while it runs).
    _unstored: dict[str, Any] | None = None

    def check_origin(self, origin: str = "") -> bool:
        # Jupyter's origin policy (`allow_origin`; a bearer token skips it), as for requests.
        return JupyterHandler.check_origin(self, origin)

    @property
    def ping_interval(self) -> float:
        # An idle socket (a long prefill, a queued response) is kept alive as an idle SSE
        # stream is: a ping at the keep-alive interval (Tornado sends none by default).
        return self.ctx.keepalive_interval

    @property
    def max_message_size(self) -> int:
        return self.ctx.max_body_bytes

    async def get(self, *args: Any, **kwargs: Any) -> None:
        if self.request.headers.get("Upgrade", "").lower() != "websocket":
            raise LMSPError(
                405,
                "method_not_allowed",
                "GET /responses opens the WebSocket mode (an 'Upgrade: websocket' request); "
                "responses are created with POST.",
                headers={"Allow": ", ".join(self.allowed_methods())},
            )
        deferred = self._deferred_error
        if deferred is not None:
            raise deferred  # credentials refused in prepare(): answered before any upgrade
        self.caller.require("responses:write")
        await super().get(*args, **kwargs)

    def open(self, *args: str, **kwargs: str) -> None:
        self._messages = asyncio.Queue()
        self._server = asyncio.get_running_loop().create_task(self._serve(self._messages))

    def on_message(self, message: str | bytes) -> None:
        assert self._messages is not None
        self._messages.put_nowait(message if isinstance(message, str) else message.decode())

    def on_close(self) -> None:
        if self._messages is not None:
            self._messages.put_nowait(None)
        unstored, self._unstored = self._unstored, None
        if unstored is not None:
            asyncio.get_running_loop().create_task(responses.abandon(self.ctx, unstored))

    async def _serve(self, messages: asyncio.Queue[str | None]) -> None:
        while (message := await messages.get()) is not None:
            try:
                await self._act_on(message)
            except WebSocketClosedError:
                return
            except LMSPError as e:
                self._send_error(e)
            except Exception:
                log.exception("A WebSocket message of /responses failed")
                self._send_error(
                    LMSPError(500, "server_error", "The message failed.", type="server_error")
                )

    async def _act_on(self, message: str) -> None:
        try:
            data = json.loads(message)
        except ValueError:
            raise invalid("The message is not JSON.", code="invalid_json") from None
        if not isinstance(data, dict):
            raise invalid("A message must be a JSON object.", code="invalid_json")
        kind = data.get("type")
        if kind == "response.create":
            await self._create({k: v for k, v in data.items() if k != "type"})
        elif kind == "response.follow":
            follow = validate(WebSocketFollow, data)
            self.caller.require("responses:read")
            await self._send_events(
                await responses.response_events(
                    self.ctx,
                    follow.response_id,
                    self.caller,
                    follow.starting_after,
                )
            )
        else:
            raise invalid(
                "'type' must be 'response.create' or 'response.follow'.",
                param="type",
                code="invalid_value" if "type" in data else "missing_required_parameter",
            )

    async def _create(self, body: dict[str, Any]) -> None:
        for name in HTTP_ONLY_FIELDS:
            if name in body:
                raise LMSPError(
                    400,
                    "unsupported_parameter",
                    f"'{name}' is not sent in WebSocket mode: the socket is the stream.",
                    param=name,
                )
        request = validate(CreateResponseRequest, {**body, "stream": True})
        ctx, caller = self.ctx, self.caller
        response = await responses.create_response(ctx, request, caller, None, self.api_prefix)
        if not request.stored:
            self._unstored = response
        try:
            await self._send_events(
                await responses.response_events(ctx, response["id"], caller, created=True)
            )
        finally:
            self._unstored = None
        await responses.discard_unstored(ctx, response)

    async def _send_events(self, events: TaskEventStream) -> None:
        try:
            async for event in events:
                if event is not None:  # idle: `ping_interval` keeps the socket alive
                    await self.write_message(json.dumps(event, separators=(",", ":")))
        finally:
            await events.aclose()
        if events.revoked:
            self._send_error(LMSPError(401, "invalid_token", "The access token was revoked."))
            self.close(1008, "access token revoked")

    def _send_error(self, error: LMSPError) -> None:
        if self.ws_connection is None:
            return
        message = WebSocketError.model_validate(
            {"status": error.status, "error": error.body()["error"]}
        )
        self.write_message(message.model_dump_json())

    def on_connection_close(self) -> None:
        if self.ws_connection is not None or self.get_status() == 101:
            super().on_connection_close()
        else:
            # A plain request (a POST): the request handler's own, not the socket's.
            super(WebSocketHandler, self).on_connection_close()


def document_extension() -> dict[str, Any]:
    """The WebSocket mode as the OpenAPI document states it on `/responses` (the Open
    Responses spec's `x-openresponses-websocket`): what a client sends, what comes back."""
    return {
        "description": "Open a WebSocket on this path (GET with 'Upgrade: websocket', the same "
        "credentials as a request). Send `response.create` messages (a POST /responses body with "
        "`type`, without `stream`, `stream_options` or `background`): each response's events "
        "come back as text messages, as the SSE stream's `data`. `response.follow` continues a "
        "stored response's events after `starting_after`. A message that cannot be acted on "
        "gets an `error` message; the socket stays open.",
        "clientMessages": {
            "response.create": {"$ref": "#/components/schemas/CreateResponseRequest"},
            "response.follow": WebSocketFollow.model_json_schema(),
        },
        "errorMessage": WebSocketError.model_json_schema(
            ref_template="#/components/schemas/{model}"
        ),
    }
