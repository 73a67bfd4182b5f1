"""Idempotency keys (LMSP B8): claiming a key, recording its result, releasing it.

A key is claimed (a row with no result yet) in its own short transaction before the work
starts, so a concurrent duplicate finds it and gets 409. The result is then written in the same
transaction as the work it started (`rules.create_task` takes the finished row), or by
`complete_key` for work that starts no task. A row left without a result by a crash started no
work (the work would have committed the result with it): the recovery of the runner that
handled it (`runner_id`) deletes such rows. A row with a result belongs to no runner.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import bindparam, delete, insert

from .database import Database
from .records import advisory_lock, get, table, upsert
from .tables import IdempotencyKey

_keys = table(IdempotencyKey)
_INSERT = insert(_keys)
_DELETE = delete(_keys).where(
    _keys.c.caller == bindparam("the_caller"), _keys.c.key == bindparam("the_key")
)
# A claim without a result (the request failed before it had one worth replaying).
_RELEASE = _DELETE.where(_keys.c.status_code.is_(None), _keys.c.response_id.is_(None))


@dataclass
class Claim:
    """What claiming a key found: a new claim, a stored result, a request in flight, or a
    different request under the same key."""

    kind: str  # "new" | "replay" | "pending" | "in_use" | "mismatch"
    row: IdempotencyKey


def claim_key(
    db: Database, caller: str, key: str, digest: str, ttl: float, runner_id: str | None = None
) -> Claim:
    """Claim `key` for the request being handled by the runner `runner_id` (the claim dies
    with that runner: its recovery releases it)."""
    now = time.time()
    with db.writing() as conn:
        # The row may not exist yet, so there is no row to lock: two claims of one key
        # take turns on its name instead (SQLite's write lock does that already).
        advisory_lock(conn, f"idempotency:{caller}\n{key}")
        row = get(conn, IdempotencyKey, caller, key, for_update=True)
        if row is not None and row.expires_at <= now:
            conn.execute(_DELETE, {"the_caller": caller, "the_key": key})
            row = None
        if row is None:
            row = IdempotencyKey(
                caller=caller,
                key=key,
                request_digest=digest,
                created_at=now,
                expires_at=now + ttl,
                runner_id=runner_id,
            )
            conn.execute(_INSERT, row.model_dump())
            return Claim("new", row)
        if row.request_digest != digest:
            return Claim("mismatch", row)
        if row.status_code is not None:
            return Claim("replay", row)
        if row.response_id is not None:
            return Claim("pending", row)
        return Claim("in_use", row)


def finished_row(
    claim_row: IdempotencyKey,
    status: int | None,
    body: Any = None,
    headers: dict[str, str] | None = None,
    response_id: str | None = None,
) -> IdempotencyKey:
    """The claimed row with its result, to be written with the work (or by `complete_key`)."""
    return IdempotencyKey(
        caller=claim_row.caller,
        key=claim_row.key,
        request_digest=claim_row.request_digest,
        response_id=response_id,
        status_code=status,
        body=json.dumps(body) if body is not None else None,
        headers=json.dumps(headers or {}),
        created_at=claim_row.created_at,
        expires_at=claim_row.expires_at,
    )


def complete_key(db: Database, row: IdempotencyKey) -> None:
    with db.writing() as conn:
        upsert(conn, row)


def release_key(db: Database, caller: str, key: str) -> None:
    """Forget a claim whose request failed without a result worth replaying (a 5xx)."""
    with db.writing() as conn:
        conn.execute(_RELEASE, {"the_caller": caller, "the_key": key})
