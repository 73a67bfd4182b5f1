"""What an endpoint is, said once: its access (a scope, public, or any authenticated caller), its
request body and query models, its replies and its error statuses.

Handlers declare an `Operation` on each method (handlers/base.py `operation`); the same object
then decides who may call it, parses its body and query, and becomes its entry in the OpenAPI
document (protocol/openapi.py). Nothing here knows about Tornado.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, TypeAdapter

from .scopes import Scope

Access = Scope | Literal["public", "authenticated"]


@dataclass(frozen=True)
class EventStream:
    """A `text/event-stream` reply. `data` are the models a `data:` line may hold (as JSON);
    `framed` streams also send `id:` (the sequence number) and `event:` (the type) lines;
    `done` is a literal last `data:` line (`[DONE]` ends a chat stream)."""

    name: str
    data: tuple[type[BaseModel], ...]
    framed: bool = True
    done: str | None = None
    description: str = ""


@dataclass(frozen=True)
class ResponseHeader:
    description: str
    required: bool = False


@dataclass(frozen=True)
class Reply:
    """One success status of an operation: a JSON body (`model`, or a raw `schema`), and/or an
    event stream, or a `text` body, with its response headers."""

    description: str
    model: type[BaseModel] | None = None
    schema: Mapping[str, Any] | None = None
    stream: EventStream | None = None
    headers: Mapping[str, ResponseHeader] = field(default_factory=dict)
    # A text body of this media type (e.g. `text/plain` for the metrics) instead of JSON.
    text: str | None = None


@dataclass(frozen=True)
class RequestHeader:
    """A request header the operation reads, validated through `type` (its schema too)."""

    name: str
    type: Any
    description: str

    @property
    def adapter(self) -> TypeAdapter[Any]:
        return TypeAdapter(self.type)


@dataclass(frozen=True)
class Operation:
    operation_id: str
    summary: str
    tag: str
    access: Access
    replies: Mapping[int, Reply]
    # Statuses beyond those the rest implies (401/403 for credentials and scopes, 400/413 for
    # a body, 409/422 for idempotency keys): 404, 409, 429, 500.
    errors: tuple[int, ...] = ()
    body: type[BaseModel] | None = None
    body_required: bool = True
    query: type[BaseModel] | None = None
    idempotent: bool = False
    headers: tuple[RequestHeader, ...] = ()
    description: str | None = None

    @property
    def public(self) -> bool:
        return self.access == "public"

    @property
    def scope(self) -> Scope | None:
        match self.access:
            case "public" | "authenticated":
                return None
            case scope:
                return scope

    def error_statuses(self) -> list[int]:
        statuses = set(self.errors)
        if not self.public:
            statuses.add(401)
        if self.scope is not None:
            statuses.add(403)
        if self.body is not None:
            statuses |= {400, 413}
        if self.query is not None or self.headers:
            statuses.add(400)
        if self.idempotent:
            statuses |= {400, 409, 422}
        return sorted(statuses)


@dataclass(frozen=True)
class Endpoint:
    """An operation at a path (`/responses/{response_id}`) and method."""

    path: str
    method: str
    operation: Operation
