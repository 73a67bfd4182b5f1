"""Pairing and paired clients (LMSP B3, shaped like RFC 8628): start, decide, poll for the
token; the owner's view of paired clients; and who a bearer token belongs to.

Every function here is database work only (the handlers run it off the IOLoop, the command
line calls it directly).

Abuse limits (docs/security.md): starting is rate-limited per remote address, and at most
`max_pending` requests wait at once: a new one ends the oldest waiting (it expires), so a
flood of starts never locks a program out of pairing (issue 43: refusing new starts at the cap
did, for up to the TTL); polling is rate-limited per pairing (polls for pairings that do not
exist share one bucket per address), so spamming either cannot lock a program out of the other.
An approving paired client grants only scopes it holds itself, never to a pairing it started.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from pydantic import TypeAdapter

from ..auth import secrets as codes
from ..auth.ratelimit import RateLimiter
from ..auth.scopes import OWNER, Caller
from ..protocol.errors import LMSPError, not_found
from ..protocol.ids import new_id
from ..protocol.objects import client_object, pairing_object
from ..protocol.pairing import (
    ClientList,
    PairingList,
    PairingStarted,
    PairingToken,
    PairingTokenRequest,
    Scopes,
    StartPairingRequest,
)
from ..protocol.validation import validate_value
from ..store import clients as store
from ..store import rules
from ..store.database import Database
from ..store.tables import Client, Pairing

log = logging.getLogger(__name__)

PAIRING_TTL = 600.0
POLL_INTERVAL = 5
# How stale `last_used_at` may get before a request writes it again (one write a minute per
# client, not one per request).
TOUCH_INTERVAL = 60.0

_SCOPES = TypeAdapter(Scopes)

_POLL_ERRORS = {
    "authorization_pending": "The owner has not approved this pairing yet; poll again later.",
    "slow_down": "Polling too fast; wait `interval` seconds between polls.",
    "access_denied": "The owner denied this pairing.",
    "expired_token": "This pairing has expired or its token was already issued.",
    "invalid_grant": "The device code does not match this pairing.",
}


def start(
    db: Database,
    request: StartPairingRequest,
    ttl: float = PAIRING_TTL,
    *,
    started_by: Caller | None = None,
    max_pending: int | None = None,
) -> dict[str, Any]:
    """Start a pairing. `started_by` is the caller when the request carried credentials."""
    device_code = codes.new_device_code()
    now = time.time()
    pairing = Pairing(
        id=new_id("pair"),
        client_name=request.client_name,
        requested_scopes=json.dumps(request.scopes),
        user_code=codes.new_user_code(),
        device_code_hash=codes.secret_hash(device_code),
        interval=POLL_INTERVAL,
        created_at=now,
        expires_at=now + ttl,
        started_by=started_by.id if started_by is not None else None,
    )
    evicted = store.create_pairing(db, pairing, max_pending)
    if evicted:
        log.info(
            "LMSP pairing: %d waiting request(s) ended to make room: %s", len(evicted), evicted
        )
    return PairingStarted(
        id=pairing.id,
        device_code=device_code,
        user_code=pairing.user_code,
        expires_at=int(pairing.expires_at),
        interval=pairing.interval,
        scopes=request.scopes,
    ).wire()


def parse_scopes(value: object) -> list[str]:
    """Scope names given on the command line, checked as the API checks them."""
    return list(validate_value(_SCOPES, value, "scopes"))


def decide(
    db: Database,
    id_or_code: str,
    approve: bool,
    scopes: list[str] | None = None,
    approver: Caller = OWNER,
) -> dict[str, Any]:
    """Approve or deny a pairing. A paired client approving (it holds `clients:admin`) grants
    only scopes it holds itself, and never decides a pairing it started. The client it becomes
    belongs to the approving Jupyter user (or to the user of the approving client): LMSP B12."""
    pairing = store.find_pairing(db, id_or_code)
    if pairing is None:
        raise not_found("pairing", id_or_code)
    updated, why = store.decide_pairing(
        db,
        pairing.id,
        approve,
        scopes,
        decided_by=approver.id,
        held=None if approver.is_owner else approver.scopes,
    )
    if why == "ok" and updated is not None:
        return pairing_object(updated)
    if why in _FORBIDDEN:
        raise LMSPError(
            403,
            f"pairing_{why}",
            _FORBIDDEN[why],
            type="permission_error",
            param="scopes" if why.startswith("scopes") else None,
        )
    messages = {
        "expired": "This pairing has expired.",
        "decided": f"This pairing was already {pairing.status}.",
        "scopes_not_requested": "Approval may narrow the requested scopes, not add to them.",
    }
    raise LMSPError(
        400,
        f"pairing_{why}",
        messages.get(why, why),
        param="scopes" if why.startswith("scopes") else None,
    )


_FORBIDDEN = {
    "scopes_not_held": "A client may grant only scopes it holds itself; narrow 'scopes'.",
    "self_approval": "A client may not decide a pairing it started itself.",
}


def poll(
    db: Database,
    pairing_id: str,
    request: PairingTokenRequest,
    limiter: RateLimiter | None = None,
    remote_address: str = "unknown",
) -> dict[str, Any]:
    """Poll for the token. With a `limiter`, polls are limited per pairing; polls for a pairing
    that does not exist share one bucket per remote address."""
    if limiter is not None:
        known = store.get_pairing(db, pairing_id) is not None
        limiter.check(f"pairing:{pairing_id}" if known else f"unknown:{remote_address}")
    result = store.poll_pairing(db, pairing_id, request.device_code)
    if result.outcome == "not_found":
        raise not_found("pairing", pairing_id)
    if result.outcome == "token":
        assert result.client is not None and result.access_token is not None
        return PairingToken(
            client_id=result.client.id,
            access_token=result.access_token,
            scopes=json.loads(result.client.scopes),
        ).wire()
    headers = None
    if result.outcome == "slow_down" and result.pairing is not None:
        headers = {"Retry-After": str(result.pairing.interval)}
    raise LMSPError(
        400,
        result.outcome,
        _POLL_ERRORS[result.outcome],
        type="authorization_error",
        headers=headers,
    )


def pending(db: Database) -> dict[str, Any]:
    return PairingList.model_validate(
        {"data": [pairing_object(p) for p in store.list_pairings(db)]}
    ).wire()


def list_clients(db: Database, caller: Caller | None = None) -> dict[str, Any]:
    """The clients `caller` manages (every client when None: the command line's view)."""
    rows = [c for c in store.list_clients(db) if caller is None or manages(caller, c)]
    return ClientList.model_validate({"data": [client_object(c) for c in rows]}).wire()


def manages(caller: Caller, client: Client) -> bool:
    """Whether `caller` may see and revoke `client` (LMSP B12): a Jupyter user the clients it
    paired (and those they approved), a paired client those it approved."""
    if caller.is_owner:
        return client.paired_by == caller.id
    return client.approved_by == caller.id


def revoke(db: Database, client_id: str) -> dict[str, Any]:
    """Revoke a client from outside a running server (the command line): the client, those it
    approved, and the cancellation of their unfinished tasks are committed together
    (`rules.revoke_client`); a running server stops their work through
    `services.revocation` when the revocation goes through it instead."""
    revocation = rules.revoke_client(db, client_id)
    if revocation is None:
        raise not_found("client", client_id)
    return client_object(revocation.clients[0])


def authenticate(db: Database, token: str) -> Caller | None:
    """The paired client whose access token this is (None: unknown or revoked); its
    `last_used_at` is brought up to date at most once a minute."""
    client = store.client_for_token(db, token)
    if client is None:
        return None
    if client.last_used_at is None or client.last_used_at < time.time() - TOUCH_INTERVAL:
        store.touch_client(db, client.id)
    return Caller(client.id, frozenset(json.loads(client.scopes)), client.name)
