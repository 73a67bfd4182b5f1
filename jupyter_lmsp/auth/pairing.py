"""The pairing flow (LMSP B3, shaped like RFC 8628): start, decide, poll for the token; and the
owner's view of paired clients."""

from __future__ import annotations

import json
import time
from typing import Any

from ..protocol.errors import LMSPError, invalid, not_found
from ..protocol.ids import new_id
from ..protocol.objects import client_object, pairing_object
from ..store import clients as store
from ..store.database import Database
from ..store.tables import Pairing
from . import secrets as codes
from .scopes import Caller, parse_scopes

PAIRING_TTL = 600.0
POLL_INTERVAL = 5

_POLL_ERRORS = {
    "authorization_pending": "The owner has not approved this pairing yet; poll again later.",
    "slow_down": "Polling too fast; wait `interval` seconds between polls.",
    "access_denied": "The owner denied this pairing.",
    "expired_token": "This pairing has expired or its token was already issued.",
    "invalid_grant": "The device code does not match this pairing.",
}


def start(db: Database, body: dict[str, Any], ttl: float = PAIRING_TTL) -> dict[str, Any]:
    name = body.get("client_name")
    if not isinstance(name, str) or not 1 <= len(name.strip()) <= 100:
        raise invalid("'client_name' must be a string of 1 to 100 characters.", param="client_name")
    scopes = parse_scopes(body.get("scopes", []))
    if not scopes:
        raise invalid("'scopes' must name at least one scope.", param="scopes")
    unknown = set(body) - {"client_name", "scopes"}
    if unknown:
        raise invalid(
            f"Unknown parameter: '{sorted(unknown)[0]}'.",
            param=sorted(unknown)[0],
            code="unknown_parameter",
        )
    device_code = codes.new_device_code()
    now = time.time()
    pairing = store.create_pairing(
        db,
        Pairing(
            id=new_id("pair"),
            client_name=name.strip(),
            requested_scopes=json.dumps(scopes),
            user_code=codes.new_user_code(),
            device_code_hash=codes.secret_hash(device_code),
            interval=POLL_INTERVAL,
            created_at=now,
            expires_at=now + ttl,
        ),
    )
    return {
        "id": pairing.id,
        "object": "pairing",
        "device_code": device_code,
        "user_code": pairing.user_code,
        "expires_at": int(pairing.expires_at),
        "interval": pairing.interval,
        "scopes": scopes,
    }


def decide(
    db: Database,
    id_or_code: str,
    approve: bool,
    scopes: object = None,
    decided_by: str | None = None,
) -> dict[str, Any]:
    """Approve or deny a pairing as `decided_by` (the caller's id): an approved client is
    that caller's, whose tasks it sees (LMSP B12)."""
    pairing = store.find_pairing(db, id_or_code)
    if pairing is None:
        raise not_found("pairing", id_or_code)
    granted = None if scopes is None else parse_scopes(scopes)
    updated, why = store.decide_pairing(db, pairing.id, approve, granted, decided_by)
    if why == "ok" and updated is not None:
        return pairing_object(updated)
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


def poll(db: Database, pairing_id: str, body: dict[str, Any]) -> dict[str, Any]:
    device_code = body.get("device_code")
    if not isinstance(device_code, str) or not device_code:
        raise invalid("'device_code' is required.", param="device_code")
    result = store.poll_pairing(db, pairing_id, device_code)
    if result.outcome == "not_found":
        raise not_found("pairing", pairing_id)
    if result.outcome == "token":
        assert result.client is not None and result.access_token is not None
        return {
            "object": "pairing.token",
            "client_id": result.client.id,
            "access_token": result.access_token,
            "token_type": "Bearer",
            "scopes": json.loads(result.client.scopes),
        }
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
    return {"object": "list", "data": [pairing_object(p) for p in store.list_pairings(db)]}


def list_clients(db: Database, caller: Caller | None = None) -> dict[str, Any]:
    """The clients `caller` paired (every client when None: the command line's view)."""
    rows = store.list_clients(db, paired_by=caller.id if caller is not None else None)
    return {"object": "list", "data": [client_object(c) for c in rows]}


def revoke(db: Database, client_id: str, caller: Caller | None = None) -> dict[str, Any]:
    """Revoke a client `caller` paired (any client when None); anyone else's is absent."""
    if caller is not None:
        found = store.get_client(db, client_id)
        if found is None or found.paired_by != caller.id:
            raise not_found("client", client_id)
    client = store.revoke_client(db, client_id)
    if client is None:
        raise not_found("client", client_id)
    return client_object(client)
