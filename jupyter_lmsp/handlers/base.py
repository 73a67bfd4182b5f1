"""The base handler: JSON bodies within the size limit, LMSP error bodies, SSE writing, auth.

Authentication is Jupyter Server's own (its token, or cookie + XSRF for the browser); a
request it does not recognise gets LMSP's 401 with `WWW-Authenticate: Bearer`.
"""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from jupyter_server.auth.decorator import allow_unauthenticated
from jupyter_server.base.handlers import APIHandler
from tornado import web
from tornado.iostream import StreamClosedError

from ..protocol.errors import LMSPError, conflict, invalid, too_large, unauthenticated
from ..protocol.requests import parse_json_body
from ..services import idempotency
from ..services.context import ServiceContext
from ..store.tables import IdempotencyKey

OWNER = "owner"

_STATUS_TYPES = {
    400: ("invalid_request_error", "invalid_request"),
    401: ("authentication_error", "invalid_token"),
    403: ("permission_error", "forbidden"),
    404: ("not_found_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    409: ("conflict_error", "conflict"),
    413: ("invalid_request_error", "request_too_large"),
}

__all__ = ["OWNER", "LMSPHandler", "allow_unauthenticated", "idempotent"]


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
        found = idempotency.begin(self.ctx, self.caller, key, digest)
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
            if e.status < 500:
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

    def check_xsrf_cookie(self) -> None:
        # A POST with no or wrong credentials (e.g. the openai SDK with a bad api_key) is a 401
        # (LMSP B1), not Jupyter's XSRF 403: the XSRF check only matters for a known user.
        if getattr(self, "_jupyter_current_user", True) is None:
            raise unauthenticated()
        super().check_xsrf_cookie()

    async def prepare(self) -> None:  # type: ignore[override]
        await super().prepare()
        if not self.current_user:
            raise unauthenticated()
        if not self.ctx.runner.started:
            self.ctx.runner.start()

    @property
    def api_prefix(self) -> str:
        """The URL path of `lmsp/v1` under this server's base_url."""
        return f"{self.base_url.rstrip('/')}/lmsp/v1"

    @property
    def caller(self) -> str:
        """Whose resources this request acts on (the Jupyter user is the owner)."""
        return OWNER

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

    async def write_sse(self, events: AsyncIterator[dict[str, Any] | None]) -> None:
        """Stream events as SSE (`id`, `event`, `data`), `: keep-alive` comments when idle.

        Every `data` carries `type` and `sequence_number`, which is all the openai SDK reads.
        """
        self.set_status(200)
        self.set_header("Content-Type", "text/event-stream; charset=utf-8")
        self.set_header("Cache-Control", "no-cache")
        self.set_header("X-Accel-Buffering", "no")
        try:
            await self.flush()
            async for event in events:
                if event is None:
                    self.write(": keep-alive\n\n")
                else:
                    data = json.dumps(event, separators=(",", ":"))
                    self.write(
                        f"id: {event['sequence_number']}\nevent: {event['type']}\ndata: {data}\n\n"
                    )
                await self.flush()
        except StreamClosedError:
            return
        finally:
            await events.aclose()  # type: ignore[attr-defined]
        self.finish()

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
            body = {"error": {"type": error_type, "code": code, "message": message, "param": None}}
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(body))

    def log_exception(self, typ, value, tb) -> None:  # type: ignore[no-untyped-def,override]
        if isinstance(value, LMSPError):
            self.log.debug(
                "%s %s -> %s %s", self.request.method, self.request.uri, value.status, value.code
            )
            return
        super().log_exception(typ, value, tb)
