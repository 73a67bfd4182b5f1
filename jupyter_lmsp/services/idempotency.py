"""Idempotent requests (LMSP B8): keys, request digests, and what a repeated key gets.

Keyed by (caller, key). The same key with the same request gets the first result again (status,
body, the same task) and starts nothing; with a different request, 422; while the first is
still being handled, 409 with `Retry-After`.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

from ..protocol.errors import LMSPError, conflict, invalid
from ..store import idempotency as store
from ..store.tables import IdempotencyKey
from .context import ServiceContext

HEADER = "Idempotency-Key"
_VALID_KEY = re.compile(r"^[\x21-\x7e]{1,255}$")


_NOT_JSON = object()


def request_digest(method: str, path: str, body: bytes, parsed: Any = _NOT_JSON) -> str:
    """sha256 over method, path and the body in canonical JSON (key order and spacing do not
    make two requests different); a body that is not JSON is digested as it is. `parsed` is
    the body's JSON value when the caller already has it."""
    if parsed is _NOT_JSON:
        try:
            parsed = json.loads(body)
        except (ValueError, UnicodeDecodeError, RecursionError):
            parsed = _NOT_JSON
    if parsed is _NOT_JSON:
        payload = body
    else:
        payload = json.dumps(parsed, sort_keys=True, separators=(",", ":")).encode()
    h = hashlib.sha256()
    for part in (method.upper().encode(), path.encode(), payload):
        h.update(len(part).to_bytes(8, "big"))
        h.update(part)
    return "sha256:" + h.hexdigest()


@dataclass
class KeyedRequest:
    """A request holding a claimed key: how its result gets recorded."""

    row: IdempotencyKey
    recorded: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def result(
        self,
        status: int | None,
        body: Any = None,
        headers: dict[str, str] | None = None,
        response_id: str | None = None,
    ) -> IdempotencyKey:
        """The finished row, for the transaction of the work this request starts."""
        self.recorded = status is not None
        return store.finished_row(self.row, status, body, headers, response_id)


@dataclass
class Replay:
    status: int
    body: Any
    headers: dict[str, str]


@dataclass
class Linked:
    """The key's first request created a response, whose final form (or events) is its
    result: the handler replays that response."""

    response_id: str


def check_key(key: str) -> None:
    if not _VALID_KEY.match(key):
        raise invalid(
            f"'{HEADER}' must be 1 to 255 visible ASCII characters.",
            param=HEADER,
            code="invalid_idempotency_key",
        )


async def begin(
    ctx: ServiceContext, caller: str, key: str, digest: str
) -> KeyedRequest | Replay | Linked:
    """Claim `key`: a `KeyedRequest` to go ahead, a `Replay` of a stored result, or the
    response a request with this key created (`Linked`: the caller replays that response)."""
    check_key(key)
    claim = await ctx.offload(
        store.claim_key,
        ctx.db,
        caller,
        key,
        digest,
        ctx.idempotency_ttl,
        runner_id=ctx.runner.runner_id,
    )
    match claim.kind:
        case "new":
            return KeyedRequest(claim.row)
        case "mismatch":
            raise LMSPError(
                422,
                "idempotency_key_mismatch",
                f"The '{HEADER}' was already used with a different request.",
                param=HEADER,
            )
        case "in_use":
            raise conflict(
                "idempotency_key_in_use",
                f"A request with this '{HEADER}' is still being handled; retry shortly.",
                retry_after=1,
            )
        case "replay":
            row = claim.row
            return Replay(
                row.status_code or 200,
                json.loads(row.body) if row.body else None,
                json.loads(row.headers) if row.headers else {},
            )
        case _:  # "pending": its result is a response that may still be running
            assert claim.row.response_id is not None
            return Linked(claim.row.response_id)


async def record(ctx: ServiceContext, keyed: KeyedRequest, status: int, body: Any) -> None:
    if not keyed.recorded:
        await ctx.offload(store.complete_key, ctx.db, keyed.result(status, body))


async def release(ctx: ServiceContext, keyed: KeyedRequest) -> None:
    await ctx.offload(store.release_key, ctx.db, keyed.row.caller, keyed.row.key)
