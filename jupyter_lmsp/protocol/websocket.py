"""The WebSocket mode of `/responses` (Open Responses): the messages a client sends on the socket
and the error the service sends back. Everything else the service sends is an event of the
response's stream, exactly as `data` of the SSE stream carries it (`protocol.events`).

- `response.create`: a `POST /responses` body with `type` beside it, and without `stream`,
  `stream_options` or `background` (the socket is the stream);
- `response.follow` (LMSP): the events of an existing response after `starting_after`, then
  the live ones to its end — how a client that lost its socket continues where it was.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from .errors import ErrorDetail
from .fields import Body, WireObject

# The `POST /responses` fields a `response.create` message must not hold.
HTTP_ONLY_FIELDS = ("stream", "stream_options", "background")


class WebSocketFollow(Body):
    """Follow a response's events after `starting_after` (-1: from the first) to its end."""

    type: Literal["response.follow"]
    response_id: str
    starting_after: Annotated[int, Field(ge=-1)] = -1


class WebSocketError(WireObject):
    """A message that could not be acted on: `status` is the HTTP status the same request
    would have had, `error` the error body. The socket stays open."""

    type: Literal["error"] = "error"
    status: int
    error: ErrorDetail
