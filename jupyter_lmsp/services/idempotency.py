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


def request_digest(method: str, path: str, body: bytes) -> str:
    """sha256 over method, path and the body in canonical JSON (key order and spacing do not
    make two requests different)."""
    try:
        canonical = json.dumps(json.loads(body), sort_keys=True, separators=(",", ":"))
        payload = canonical.encode()
    except (ValueError, UnicodeDecodeError):
        payload = body
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


def begin(
    ctx: ServiceContext, caller: str, key: str, digest: str
) -> KeyedRequest | Replay | IdempotencyKey:
    """Claim `key`: a `KeyedRequest` to go ahead, a `Replay` of a stored result, or the row of a
    request whose result is a response (the caller replays that response)."""
    if not _VALID_KEY.match(key):
        raise invalid(
            f"'{HEADER}' must be 1 to 255 visible ASCII characters.",
            param=HEADER,
            code="invalid_idempotency_key",
        )
    claim = store.claim_key(
        ctx.db, caller, key, digest, ctx.idempotency_ttl, runner_id=ctx.runner.runner_id
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
            return claim.row


def record(ctx: ServiceContext, keyed: KeyedRequest, status: int, body: Any) -> None:
    if not keyed.recorded:
        store.complete_key(ctx.db, keyed.result(status, body))


def release(ctx: ServiceContext, keyed: KeyedRequest) -> None:
    store.release_key(ctx.db, keyed.row.caller, keyed.row.key)
