"""The base handler: request bodies within the size limit, who is calling, the `operation`
decorator every endpoint method wears, LMSP error bodies, SSE writing.

Two kinds of caller (LMSP B3). A paired client sends `Authorization: Bearer lmsp_…`; its
request skips Jupyter's XSRF and origin checks (it carries no cookie to forge). Anyone else is
authenticated by Jupyter Server itself (its token, or the browser's cookie + XSRF) and acts as
that Jupyter user (`services.callers.jupyter_caller`). A request neither recognises gets 401
with `WWW-Authenticate: Bearer`.

Bodies are streamed in (`stream_request_body`): a body over `max_body_bytes` is refused with
413 from its `Content-Length`, before anything reads it, or as soon as that many bytes of a
chunked body arrived; Tornado would otherwise read any body (up to Jupyter's 512 MiB) into
memory before the handler runs. A request refused for its credentials (or its path) is
answered once its body, within the limit, has arrived and been dropped unread: an answer
written from `prepare()` would make Tornado close the client's kept-alive connection.

An endpoint method is declared once with `@operation(...)`: its access (a scope, `public`, or
any `authenticated` caller), replies, errors and idempotency; its body and query models are the
annotations of its `body` and `query` parameters. The same declaration enforces the access,
parses and validates the request, honours `Idempotency-Key`, and becomes the method's entry in
the OpenAPI document.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import re
import types
import typing
from collections import OrderedDict
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from typing import Any, TypeVar

from jupyter_server.auth.decorator import allow_unauthenticated
from jupyter_server.base.handlers import APIHandler
from pydantic import BaseModel
from tornado import web
from tornado.http1connection import HTTP1Connection
from tornado.iostream import StreamClosedError

from .. import failpoints
from ..auth import secrets as codes
from ..auth.scopes import Caller
from ..protocol.errors import LMSPError, conflict, invalid, too_large, unauthenticated
from ..protocol.operations import Access, Operation, Reply, RequestHeader
from ..protocol.validation import parse_json, validate, validate_query, validate_value
from ..services import idempotency, metrics, pairing
from ..services.callers import jupyter_caller
from ..services.context import ServiceContext
from ..services.follow import TaskEventStream

T = TypeVar("T")

# What an operation with an optional body got when none was sent.
_NO_BODY = object()

_STATUS_TYPES = {
    400: ("invalid_request_error", "invalid_request"),
    401: ("authentication_error", "invalid_token"),
    403: ("permission_error", "forbidden"),
    404: ("not_found_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    409: ("conflict_error", "conflict"),
    413: ("invalid_request_error", "request_too_large"),
}

# Query parameters whose names contain one of these may carry a credential (`?token=…`, as
# Jupyter accepts its token): their values never reach a log (Jupyter's access log scrubs the
# same ones, jupyter_server.log._scrub_uri).
_SECRET_PARAMS = ("token", "auth", "key", "code", "secret", "password", "xsrf")
_QUERY_PARAM = re.compile(r"([?&])([^=&#]*)(=?)([^&#]*)")

__all__ = ["LMSPHandler", "operation", "redact_uri"]


# A live event reaches every watcher of its task as the same dict: its frame is serialized once
# (200 readers of one task cost one json.dumps per event, not 200). The cache holds the event
# itself, so an id() is never reused while its entry lives.
_FRAMES: OrderedDict[int, tuple[dict[str, Any], str]] = OrderedDict()
_FRAME_CACHE_SIZE = 4096


# At most this many frames go out in one write: a long replay still takes turns with the
# other streams of the IOLoop.
SSE_EVENTS_PER_FLUSH = 64


def sse_frame(event: dict[str, Any]) -> str:
    """`id`, `event` and `data` lines of one SSE event (LMSP B6)."""
    cached = _FRAMES.get(id(event))
    if cached is not None and cached[0] is event:
        return cached[1]
    data = json.dumps(event, separators=(",", ":"))
    frame = f"id: {event['sequence_number']}\nevent: {event['type']}\ndata: {data}\n\n"
    _FRAMES[id(event)] = (event, frame)
    if len(_FRAMES) > _FRAME_CACHE_SIZE:
        _FRAMES.popitem(last=False)
    return frame


def _retried(headers: Any) -> bool:
    """Whether the openai SDK says this is a retry (`x-stainless-retry-count` > 0)."""
    count = headers.get("x-stainless-retry-count", "0")
    return count.isdigit() and int(count) > 0


def redact_uri(uri: str) -> str:
    """`uri` with the values of credential parameters replaced by `[secret]`."""

    def scrub(match: re.Match[str]) -> str:
        lead, name, equals, value = match.groups()
        if any(word in name.lower() for word in _SECRET_PARAMS):
            value = "[secret]"
        return f"{lead}{name}{equals}{value}"

    return _QUERY_PARAM.sub(scrub, uri)


def _model_of(annotation: Any) -> tuple[type[BaseModel] | None, bool]:
    """The model a `body`/`query` annotation names, and whether it may be absent."""
    if annotation is None:
        return None, True
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(members) == 1:
            return _model_of(members[0])[0], True
    raise TypeError(f"not a request model: {annotation!r}")


def operation(
    operation_id: str,
    summary: str,
    tag: str,
    *,
    access: Access,
    replies: Mapping[int, Reply],
    errors: tuple[int, ...] = (),
    idempotent: bool = False,
    headers: tuple[RequestHeader, ...] = (),
    description: str | None = None,
) -> Callable[[Callable[..., Awaitable[None]]], Callable[..., Awaitable[None]]]:
    """Declare an endpoint method (see the module docstring). The method receives its path
    arguments, then `body=` and `query=` (validated models) if it declares them, and each of
    `headers` by its name in snake case (`last_event_id=`), None when absent."""

    def decorate(fn: Callable[..., Awaitable[None]]) -> Callable[..., Awaitable[None]]:
        hints = typing.get_type_hints(fn)
        body, body_optional = _model_of(hints.get("body"))
        query, _ = _model_of(hints.get("query"))
        op = Operation(
            operation_id=operation_id,
            summary=summary,
            tag=tag,
            access=access,
            replies=replies,
            errors=errors,
            body=body,
            body_required=not body_optional,
            query=query,
            idempotent=idempotent,
            headers=headers,
            description=description,
        )

        @functools.wraps(fn)
        async def method(self: LMSPHandler, *path_args: str) -> None:
            await self.run_operation(op, fn, path_args)

        # A function attribute marks the method, as Jupyter's own decorators do.
        method.operation = op  # type: ignore[attr-defined]
        # LMSP authenticates its callers itself (Jupyter's decorator: no redirect to login).
        return allow_unauthenticated(method)

    return decorate


def operation_of(method: Any) -> Operation | None:
    """The `Operation` an endpoint method was declared with."""
    return getattr(method, "operation", None)


@web.stream_request_body
class LMSPHandler(APIHandler):
    ctx: ServiceContext
    keyed: idempotency.KeyedRequest | None = None
    written_json: tuple[int, Any] | None = None
    _deferred_error: Exception | None = None
    lmsp_caller: Caller | None = None
    bearer_client: bool = False
    # The error code of the answer, when it is an error (for the metrics).
    error_code: str | None = None
    # Its GET only opens a WebSocket (handlers.websocket), which is no documented operation.
    websocket_get: bool = False
    # A route's own body limit, below `max_body_bytes` (an unauthenticated route's: a few KiB).
    body_limit: int | None = None

    def initialize(self, ctx: ServiceContext) -> None:
        self.ctx = ctx
        self._chunks: list[bytes] = []
        self._received = 0

    # -- the request body ------------------------------------------------------------------

    def _check_declared_size(self) -> None:
        declared = self.request.headers.get("Content-Length")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                raise invalid("'Content-Length' is not a number.", param="Content-Length") from None
            if size > self._body_limit():
                raise too_large(self._body_limit())
        # A body that trickles in is dropped (with the connection) after this long.
        if isinstance(self.request.connection, HTTP1Connection):
            self.request.connection.set_body_timeout(self.ctx.body_timeout)

    def data_received(self, chunk: bytes) -> None:
        if self._finished:
            return  # already answered (a 413): the rest is discarded with the connection
        self._received += len(chunk)
        if self._received > self._body_limit():
            self._chunks.clear()
            error = too_large(self._body_limit())
            self.send_error(error.status, exc_info=(type(error), error, None))
            return
        if self._deferred_error is None:  # a refused request's body is counted, never kept
            self._chunks.append(chunk)

    def _body_limit(self) -> int:
        limit = self.ctx.max_body_bytes
        return min(limit, self.body_limit) if self.body_limit is not None else limit

    def admit_early(self) -> None:
        """Checks a route makes before its body is read (a rate limit); an `LMSPError` raised
        here is its answer, and the body (within its limit) is dropped unread."""

    @property
    def raw_body(self) -> bytes:
        return b"".join(self._chunks)

    # -- who is calling --------------------------------------------------------------------

    # Async, as Jupyter's own APIHandler.prepare (which overrides Tornado's the same way).
    async def prepare(self) -> None:  # type: ignore[override]
        # Before anything else looks at the request: its size, then its credentials.
        self._check_declared_size()
        try:
            self.admit_early()
            await self._prepare_caller()
        except (LMSPError, web.HTTPError) as e:
            # Answered from the operation, once the body (within the limit) has arrived and
            # been dropped unread: an answer written from prepare() makes Tornado close the
            # connection, and the client's next request on it would meet a reset.
            self._deferred_error = e

    async def _prepare_caller(self) -> None:
        await self._authenticate_bearer()
        await super().prepare()
        if self.lmsp_caller is None and self.current_user:
            # LMSP B12: the Jupyter identity owns what it creates; its scopes are what
            # Jupyter's authorizer (JupyterHub's, in a Hub) allows it.
            self.lmsp_caller = await jupyter_caller(self, self.ctx.db, self.ctx.owner_from)
        if self.lmsp_caller is None and not self._is_public():
            raise unauthenticated()
        if not self.ctx.runner.started:
            self.ctx.runner.start()
        if not self.ctx.registrar.started:
            self.ctx.registrar.start()

    async def _authenticate_bearer(self) -> None:
        scheme, _, credential = self.request.headers.get("Authorization", "").partition(" ")
        credential = credential.strip()
        if scheme.lower() != "bearer" or not credential.startswith(codes.TOKEN_PREFIX):
            return  # not ours: Jupyter's own authentication decides
        caller = await self.ctx.offload(pairing.authenticate, self.ctx.db, credential)
        if caller is None:
            raise unauthenticated("The access token is unknown or was revoked.")
        self.bearer_client = True
        self.lmsp_caller = caller

    def _operation(self) -> Operation | None:
        return operation_of(getattr(self, (self.request.method or "get").lower(), None))

    def _is_public(self) -> bool:
        op = self._operation()
        return op is not None and op.public

    def check_xsrf_cookie(self) -> None:
        # XSRF protects cookie-authenticated browsers. A bearer token or a credential-free
        # public endpoint has no ambient authority to forge.
        if self.bearer_client or self._is_public():
            return None
        # A POST with no or wrong credentials (e.g. the openai SDK with a bad api_key) is a 401
        # (LMSP B1), not Jupyter's XSRF 403: the XSRF check only matters for a known user.
        if getattr(self, "_jupyter_current_user", True) is None:
            raise unauthenticated()
        return super().check_xsrf_cookie()

    def skip_check_origin(self) -> bool:
        return self.bearer_client or super().skip_check_origin()

    @property
    def api_prefix(self) -> str:
        """The URL path of `lmsp/v1` under this server's base_url."""
        return f"{self.base_url.rstrip('/')}/lmsp/v1"

    @property
    def caller(self) -> Caller:
        """Who is calling: the owner (the Jupyter user) or a paired client."""
        if self.lmsp_caller is None:
            raise unauthenticated()
        return self.lmsp_caller

    @property
    def remote_address(self) -> str:
        return self.request.remote_ip or "unknown"

    # -- running an operation --------------------------------------------------------------

    async def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """A service function: a coroutine function is awaited (it keeps its own database work
        off the loop), a plain one runs on a database thread."""
        if inspect.iscoroutinefunction(fn):
            return await fn(*args, **kwargs)
        return await self.ctx.offload(fn, *args, **kwargs)

    async def run_operation(
        self, op: Operation, fn: Callable[..., Awaitable[None]], path_args: tuple[str, ...]
    ) -> None:
        if self._finished:
            return  # the body was refused while it arrived (413)
        if self._deferred_error is not None:
            raise self._deferred_error
        failpoints.hit(f"raise_in_{op.operation_id}")
        if op.scope is not None:
            self.caller.require(op.scope)
        kwargs: dict[str, Any] = {}
        if op.query is not None:
            kwargs["query"] = validate_query(op.query, self._query_arguments())
        for header in op.headers:
            raw = self.request.headers.get(header.name)
            kwargs[header.name.lower().replace("-", "_")] = (
                None if raw is None else validate_value(header.adapter, raw, header.name)
            )
        key = self.request.headers.get(idempotency.HEADER)
        if key is None and self.request.method == "POST" and _retried(self.request.headers):
            # The openai SDK retried a request that may have done its work already.
            metrics.unkeyed_retry(op.operation_id)
        if key is not None and not op.idempotent and self.request.method == "POST":
            # A credential-free route keys nothing before the caller is known (and starting a
            # pairing answers a secret, which must never be stored to be replayed).
            raise invalid(
                f"This endpoint takes no '{idempotency.HEADER}'; send the request again instead.",
                param=idempotency.HEADER,
                code="idempotency_key_not_supported",
            )
        parsed: Any = _NO_BODY
        parse_error: LMSPError | None = None
        if op.body is not None and (self._received or op.body_required):
            try:
                parsed = parse_json(self.raw_body)
            except LMSPError as e:
                parse_error = e
        if key is None or not op.idempotent:
            if parse_error is not None:
                raise parse_error
            await self._invoke(op, fn, path_args, parsed, kwargs)
            return
        await self._keyed(op, fn, path_args, key, parsed, parse_error, kwargs)

    async def _invoke(
        self,
        op: Operation,
        fn: Callable[..., Awaitable[None]],
        path_args: tuple[str, ...],
        parsed: Any,
        kwargs: dict[str, Any],
    ) -> None:
        if op.body is not None:
            kwargs["body"] = None if parsed is _NO_BODY else validate(op.body, parsed)
        await fn(self, *path_args, **kwargs)

    async def _keyed(
        self,
        op: Operation,
        fn: Callable[..., Awaitable[None]],
        path_args: tuple[str, ...],
        key: str,
        parsed: Any,
        parse_error: LMSPError | None,
        kwargs: dict[str, Any],
    ) -> None:
        """Honour `Idempotency-Key` (LMSP B8).

        A replayed result is written as first written, with `Idempotent-Replayed: true`. A
        result the method writes as JSON is recorded after it (unless the work already recorded
        it in its own transaction); a 4xx is recorded too (a malformed body's included), a 5xx
        releases the key so a retry can run.
        """
        idempotency.check_key(key)
        digest = idempotency.request_digest(
            self.request.method or "POST",
            self.request.path,
            self.raw_body,
            **({} if parse_error is not None or parsed is _NO_BODY else {"parsed": parsed}),
        )
        try:
            found = await idempotency.begin(self.ctx, self.caller.id, key, digest)
        except LMSPError as e:
            metrics.idempotent(op.operation_id, "mismatch" if e.status == 422 else "conflict")
            raise
        metrics.idempotent(
            op.operation_id, "new" if isinstance(found, idempotency.KeyedRequest) else "replayed"
        )
        if isinstance(found, idempotency.Replay):
            self.set_header("Idempotent-Replayed", "true")
            for name, value in found.headers.items():
                self.set_header(name, value)
            self.write_json(found.body, found.status)
            return
        if isinstance(found, idempotency.Linked):
            self.set_header("Idempotent-Replayed", "true")
            await self.replay_response_result(found.response_id, parsed)
            return
        self.keyed = found
        try:
            if parse_error is not None:
                raise parse_error
            await self._invoke(op, fn, path_args, parsed, kwargs)
        except LMSPError as e:
            # A 429 (a quota, a rate limit) says "not now": the same key may be retried later.
            if e.status < 500 and e.status != 429:
                await idempotency.record(self.ctx, found, e.status, e.body())
            else:
                await idempotency.release(self.ctx, found)
            raise
        except BaseException:
            await idempotency.release(self.ctx, found)
            raise
        if self.written_json is not None:
            await idempotency.record(self.ctx, found, *self.written_json)

    async def replay_response_result(self, response_id: str, parsed: Any) -> None:
        """Replay a request whose result is a response (overridden where that can happen)."""
        raise conflict(
            "idempotency_key_in_use",
            "A request with this 'Idempotency-Key' is still being handled; retry shortly.",
            retry_after=1,
        )

    def _query_arguments(self) -> dict[str, list[str]]:
        return {
            name: [self.decode_argument(v, name=name) for v in values]
            for name, values in self.request.query_arguments.items()
        }

    # -- output ----------------------------------------------------------------------------

    def write_json(self, obj: Any, status: int = 200) -> None:
        self.written_json = (status, obj)
        self.set_status(status)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(obj))

    async def stream_sse(
        self, frames: AsyncGenerator[str, None], ready: Callable[[], bool] = lambda: False
    ) -> bool:
        """Answer 200 with `frames` as a `text/event-stream`; False if the client went away.

        Frames already at hand (`ready()` says another one is) go out in one flush, up to
        `SSE_EVENTS_PER_FLUSH`: a task's closing events, or a replay.
        """
        self.set_status(200)
        self.set_header("Content-Type", "text/event-stream; charset=utf-8")
        self.set_header("Cache-Control", "no-cache")
        self.set_header("X-Accel-Buffering", "no")
        metrics.sse_opened(reconnect="Last-Event-ID" in self.request.headers)
        try:
            await self.flush()
            unflushed = 0
            async for frame in frames:
                self.write(frame)
                unflushed += 1
                if ready() and unflushed < SSE_EVENTS_PER_FLUSH:
                    continue
                unflushed = 0
                await self.flush()
                # A flush into a writable socket completes without yielding: with more frames
                # at hand, one watcher would write every queued event (and finish its request)
                # before the next watcher of the same task got its first one. With none, the
                # next frame's wait yields anyway (a loop turn less per frame, issue 42).
                if ready():
                    await asyncio.sleep(0)
        except StreamClosedError:
            return False
        except LMSPError as e:
            # The server stops (SIGTERM) under an open stream: it ends, as when the server is
            # gone; the client reconnects with Last-Event-ID. Nothing to log, no status to send.
            if e.code != "server_shutting_down":
                raise
        finally:
            metrics.sse_closed()
            await frames.aclose()
        self.finish()
        return True

    async def write_sse(self, events: TaskEventStream) -> bool:
        """Stream a task's events as SSE (`id`, `event`, `data`), `: keep-alive` comments when
        idle. Every `data` carries `type` and `sequence_number`, which is all the openai SDK
        reads. False if the client went away before the stream's end."""

        async def frames() -> AsyncGenerator[str, None]:
            try:
                async for event in events:
                    yield ": keep-alive\n\n" if event is None else sse_frame(event)
            finally:
                await events.aclose()

        return await self.stream_sse(frames(), lambda: events.ready)

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info", (None, None, None))[1]
        if isinstance(exc, LMSPError):
            self.set_status(exc.status)
            for name, value in exc.headers.items():
                self.set_header(name, value)
            body = exc.body()
            self.error_code = exc.code
        else:
            error_type, code = _STATUS_TYPES.get(status_code, ("server_error", "server_error"))
            self.error_code = code
            if status_code == 403 and self.request.method not in ("GET", "HEAD", "OPTIONS"):
                self.error_code = "xsrf_failed"
            message = (
                exc.log_message
                if isinstance(exc, web.HTTPError) and exc.log_message
                else self._reason
            )
            if status_code == 403 and self.request.method not in ("GET", "HEAD", "OPTIONS"):
                message = message or "Forbidden (XSRF check failed)."
            if status_code == 401:
                self.set_header("WWW-Authenticate", 'Bearer realm="lmsp"')
            if status_code == 405:
                # RFC 9110: a 405 lists the methods the resource does support.
                self.set_header("Allow", ", ".join(self.allowed_methods()))
            body = {"error": {"type": error_type, "code": code, "message": message, "param": None}}
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(body))

    def on_finish(self) -> None:
        op = self._operation()
        metrics.on_request(
            op.operation_id if op is not None else "unknown",
            self.request.method or "GET",
            self.get_status(),
            self.request.request_time(),
            self.error_code,
        )

    def allowed_methods(self) -> list[str]:
        """The HTTP methods this handler implements (a GET that only opens a WebSocket is
        none: a plain GET is refused)."""
        return [
            m
            for m in ("GET", "POST", "PUT", "PATCH", "DELETE")
            if getattr(type(self), m.lower()) is not getattr(web.RequestHandler, m.lower())
            and not (m == "GET" and self.websocket_get)
        ]

    def _request_summary(self) -> str:
        # Tornado's access and error log lines: the URL without credentials.
        return (
            f"{self.request.method} {redact_uri(self.request.uri or '')} ({self.request.remote_ip})"
        )

    def log_exception(
        self,
        typ: type[BaseException] | None,
        value: BaseException | None,
        tb: types.TracebackType | None,
    ) -> None:
        if isinstance(value, LMSPError):
            self.log.debug(
                "%s %s -> %s %s",
                self.request.method,
                redact_uri(self.request.uri or ""),
                value.status,
                value.code,
            )
            return
        if isinstance(value, web.HTTPError):
            super().log_exception(typ, value, tb)
            return
        # Tornado's own line names the whole request (`repr(self.request)`, the raw URL
        # with any `?token=`): this one names it without credentials.
        self.log.error("Uncaught exception %s", self._request_summary(), exc_info=value)
