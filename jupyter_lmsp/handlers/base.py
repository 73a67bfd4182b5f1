"""The base handler: who is calling, JSON bodies within the size limit, LMSP error bodies,
SSE writing, and the decorators every endpoint method wears.

Two kinds of caller (LMSP B3). A paired client sends `Authorization: Bearer lmsp_…`; its
request skips Jupyter's XSRF and origin checks (it carries no cookie to forge). Anyone else is
authenticated by Jupyter Server itself (its token, or the browser's cookie + XSRF) and acts as
the owner. A request neither recognises gets 401 with `WWW-Authenticate: Bearer`.

Method decorators, outermost first: `@allow_unauthenticated` (Jupyter's: we authenticate
ourselves), then `@public` or `@requires(scope)`, then `@idempotent`.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Any

from jupyter_server.auth.decorator import allow_unauthenticated
from jupyter_server.base.handlers import APIHandler
from tornado import web
from tornado.iostream import StreamClosedError

from ..auth import secrets as codes
from ..auth.scopes import OWNER as OWNER_CALLER
from ..auth.scopes import Caller
from ..protocol.errors import LMSPError, conflict, invalid, too_large, unauthenticated
from ..protocol.requests import parse_json_body
from ..services import idempotency
from ..services.context import ServiceContext
from ..services.follow import TaskEventStream
from ..store import clients
from ..store.tables import IdempotencyKey

# How stale `last_used_at` may get before a request writes it again (one write a minute per
# client, not one per request).
TOUCH_INTERVAL = 60.0

_STATUS_TYPES = {
    400: ("invalid_request_error", "invalid_request"),
    401: ("authentication_error", "invalid_token"),
    403: ("permission_error", "forbidden"),
    404: ("not_found_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    409: ("conflict_error", "conflict"),
    413: ("invalid_request_error", "request_too_large"),
}

__all__ = ["LMSPHandler", "allow_unauthenticated", "idempotent", "public", "requires"]


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


def public(method: Callable[..., Any]) -> Callable[..., Any]:
    """An endpoint that needs no credentials (starting a pairing, polling for its token)."""
    method._lmsp_public = True  # type: ignore[attr-defined]
    return method


def requires(scope: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """An endpoint that needs `scope` (the owner holds every scope)."""

    def decorate(method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def wrapper(self: LMSPHandler, *args: Any) -> Any:
            self.caller.require(scope)
            return method(self, *args)

        wrapper._lmsp_scope = scope  # type: ignore[attr-defined]
        return wrapper

    return decorate


def idempotent(method: Callable[..., Any]) -> Callable[..., Any]:
    """Honour `Idempotency-Key` on a POST (LMSP B8).

    A replayed result is written as first written, with `Idempotent-Replayed: true`. A result
    the method writes as JSON is recorded after it (unless the work already recorded it in its
    own transaction); a 4xx is recorded too, a 5xx releases the key so a retry can run.
    """

    @functools.wraps(method)
    async def wrapper(self: LMSPHandler, *args: Any) -> None:
        key = self.request.headers.get(idempotency.HEADER)
        if key is None:
            await _maybe_await(method(self, *args))
            return
        digest = idempotency.request_digest(
            self.request.method or "POST", self.request.path, self.request.body
        )
        found = idempotency.begin(self.ctx, self.caller.id, key, digest)
        if isinstance(found, idempotency.Replay):
            self.set_header("Idempotent-Replayed", "true")
            for name, value in found.headers.items():
                self.set_header(name, value)
            self.write_json(found.body, found.status)
            return
        if isinstance(found, IdempotencyKey):
            self.set_header("Idempotent-Replayed", "true")
            await self.replay_response_result(found)
            return
        self.keyed = found
        try:
            await _maybe_await(method(self, *args))
        except LMSPError as e:
            # A 429 (a quota, a rate limit) says "not now": the same key may be retried later.
            if e.status < 500 and e.status != 429:
                idempotency.record(self.ctx, found, e.status, e.body())
            else:
                idempotency.release(self.ctx, found)
            raise
        except BaseException:
            idempotency.release(self.ctx, found)
            raise
        if self.written_json is not None:
            idempotency.record(self.ctx, found, *self.written_json)

    return wrapper


async def _maybe_await(value: Any) -> Any:
    if inspect.isawaitable(value):
        return await value
    return value


class LMSPHandler(APIHandler):
    ctx: ServiceContext
    keyed: idempotency.KeyedRequest | None = None
    written_json: tuple[int, Any] | None = None

    def initialize(self, ctx: ServiceContext) -> None:
        self.ctx = ctx

    async def replay_response_result(self, row: IdempotencyKey) -> None:
        """Replay a request whose result is a response (overridden where that can happen)."""
        raise conflict(
            "idempotency_key_in_use",
            "A request with this 'Idempotency-Key' is still being handled; retry shortly.",
            retry_after=1,
        )

    lmsp_caller: Caller | None = None
    bearer_client: bool = False

    async def prepare(self) -> None:  # type: ignore[override]
        self._authenticate_bearer()
        await super().prepare()
        if self.lmsp_caller is None and self.current_user:
            self.lmsp_caller = OWNER_CALLER
        if self.lmsp_caller is None and not self._is_public():
            raise unauthenticated()
        if not self.ctx.runner.started:
            self.ctx.runner.start()
        if not self.ctx.registrar.started:
            self.ctx.registrar.start()

    def _authenticate_bearer(self) -> None:
        scheme, _, credential = self.request.headers.get("Authorization", "").partition(" ")
        credential = credential.strip()
        if scheme.lower() != "bearer" or not credential.startswith(codes.TOKEN_PREFIX):
            return  # not ours: Jupyter's own authentication decides
        client = clients.client_for_token(self.ctx.db, credential)
        if client is None:
            raise unauthenticated("The access token is unknown or was revoked.")
        self.bearer_client = True
        self.lmsp_caller = Caller(client.id, frozenset(json.loads(client.scopes)), client.name)
        if client.last_used_at is None or client.last_used_at < time.time() - TOUCH_INTERVAL:
            clients.touch_client(self.ctx.db, client.id)

    def _is_public(self) -> bool:
        method = getattr(self, (self.request.method or "get").lower(), None)
        return bool(getattr(method, "_lmsp_public", False))

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

    # -- input -----------------------------------------------------------------------------

    def json_body(self) -> dict[str, Any]:
        if len(self.request.body) > self.ctx.max_body_bytes:
            raise too_large(self.ctx.max_body_bytes)
        return parse_json_body(self.request.body)

    def int_argument(self, name: str, default: int) -> int:
        raw = self.get_query_argument(name, None)
        if raw is None or raw == "":
            return default
        try:
            return int(raw)
        except ValueError:
            raise invalid(
                f"'{name}' must be an integer.", param=name, code="invalid_type"
            ) from None

    def flag_argument(self, name: str) -> bool:
        raw = self.get_query_argument(name, "false").lower()
        if raw not in ("true", "false", "1", "0"):
            raise invalid(f"'{name}' must be true or false.", param=name, code="invalid_type")
        return raw in ("true", "1")

    # -- output ----------------------------------------------------------------------------

    def write_json(self, obj: Any, status: int = 200) -> None:
        self.written_json = (status, obj)
        self.set_status(status)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(obj))

    async def stream_sse(
        self, frames: AsyncIterator[str], ready: Callable[[], bool] = lambda: False
    ) -> bool:
        """Answer 200 with `frames` as a `text/event-stream`; False if the client went away.

        Frames already at hand (`ready()` says another one is) go out in one flush, up to
        `SSE_EVENTS_PER_FLUSH`: a task's closing events, or a replay.
        """
        self.set_status(200)
        self.set_header("Content-Type", "text/event-stream; charset=utf-8")
        self.set_header("Cache-Control", "no-cache")
        self.set_header("X-Accel-Buffering", "no")
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
                # A flush into a writable socket completes without yielding: without this, one
                # watcher would write every queued event (and finish its request) before the
                # next watcher of the same task got its first one.
                await asyncio.sleep(0)
        except StreamClosedError:
            return False
        finally:
            await frames.aclose()  # type: ignore[attr-defined]
        self.finish()
        return True

    async def write_sse(self, events: TaskEventStream) -> None:
        """Stream a task's events as SSE (`id`, `event`, `data`), `: keep-alive` comments when
        idle. Every `data` carries `type` and `sequence_number`, which is all the openai SDK
        reads."""

        async def frames() -> AsyncIterator[str]:
            try:
                async for event in events:
                    yield ": keep-alive\n\n" if event is None else sse_frame(event)
            finally:
                await events.aclose()

        await self.stream_sse(frames(), lambda: events.ready)

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info", (None, None, None))[1]
        if isinstance(exc, LMSPError):
            self.set_status(exc.status)
            for name, value in exc.headers.items():
                self.set_header(name, value)
            body = exc.body()
        else:
            error_type, code = _STATUS_TYPES.get(status_code, ("server_error", "server_error"))
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

    def allowed_methods(self) -> list[str]:
        """The HTTP methods this handler implements."""
        return [
            m
            for m in ("GET", "POST", "PUT", "PATCH", "DELETE")
            if getattr(type(self), m.lower()) is not getattr(web.RequestHandler, m.lower())
        ]

    def log_exception(self, typ, value, tb) -> None:  # type: ignore[no-untyped-def,override]
        if isinstance(value, LMSPError):
            self.log.debug(
                "%s %s -> %s %s", self.request.method, self.request.uri, value.status, value.code
            )
            return
        super().log_exception(typ, value, tb)
