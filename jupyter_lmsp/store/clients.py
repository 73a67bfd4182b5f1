"""Paired clients and pairing requests (the `clients` table of 11.1, and `pairings`).

Every function is one transaction. Polling for a token (`poll_pairing`) checks the device
code, the state, the expiry and the polling interval and, when the owner approved, creates the
client and marks the pairing claimed, all in one transaction: a token is released exactly once.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from sqlalchemy import bindparam, insert, select, update
from sqlalchemy.engine import Connection

from ..auth import secrets as codes
from ..auth.identity import is_jupyter_owner
from .database import Database
from .records import get, record, records, save, table
from .tables import Client, Pairing

MAX_FAILED_POLLS = 5
SLOW_DOWN_STEP = 5

_pairings = table(Pairing)
_clients = table(Client)
_INSERT_PAIRING = insert(_pairings)
_INSERT_CLIENT = insert(_clients)
# Unexpired pending requests, the oldest first.
_WAITING = (
    select(_pairings.c.id)
    .where(_pairings.c.status == "pending", _pairings.c.expires_at > bindparam("now"))
    .order_by(_pairings.c.created_at, _pairings.c.id)
)
# Ends a pending request at once (it expires now: polling it says `expired_token`).
_EVICT = (
    update(_pairings)
    .where(_pairings.c.id.in_(bindparam("ids", expanding=True)), _pairings.c.status == "pending")
    .values(expires_at=bindparam("now"))
)
_PENDING_BY_CODE = select(_pairings).where(
    _pairings.c.user_code == bindparam("code"),
    _pairings.c.status == "pending",
    _pairings.c.expires_at > bindparam("now"),
)
_CLIENT_BY_TOKEN = select(_clients).where(_clients.c.token_hash == bindparam("wanted"))
_TOUCH = (
    update(_clients)
    .where(_clients.c.id == bindparam("client_id"))
    .values(last_used_at=bindparam("now"))
)
_PAIRED_BY = select(_clients.c.id).where(_clients.c.paired_by == bindparam("owner"))


def create_pairing(db: Database, pairing: Pairing, max_pending: int | None = None) -> list[str]:
    """Store a new pairing request. When `max_pending` unexpired requests already wait, the
    oldest of them expire now to make room (the new one is always stored: a flood of starts
    cannot lock a program out of pairing; the flooder's own earlier requests are as old as any).
    The ids of the requests ended so. Counting, ending and inserting share the transaction, so
    concurrent starts cannot overshoot."""
    evicted: list[str] = []
    with db.writing() as conn:
        if max_pending is not None:
            waiting = list(conn.execute(_WAITING, {"now": pairing.created_at}).scalars())
            evicted = waiting[: max(0, len(waiting) - max_pending + 1)]
            if evicted:
                conn.execute(_EVICT, {"ids": evicted, "now": pairing.created_at})
        conn.execute(_INSERT_PAIRING, pairing.model_dump())
    return evicted


def get_pairing(db: Database, pairing_id: str) -> Pairing | None:
    with db.reading() as conn:
        return get(conn, Pairing, pairing_id)


def list_pairings(db: Database, status: str | None = "pending") -> list[Pairing]:
    """Pairing requests, oldest first (a flood of new ones never pushes an earlier one down)."""
    now = time.time()
    query = select(_pairings).order_by(_pairings.c.created_at)
    if status is not None:
        query = query.where(_pairings.c.status == status)
    if status == "pending":
        query = query.where(_pairings.c.expires_at > now)
    with db.reading() as conn:
        return records(Pairing, conn.execute(query))


def find_pairing(db: Database, id_or_user_code: str) -> Pairing | None:
    with db.reading() as conn:
        pairing = get(conn, Pairing, id_or_user_code)
        if pairing is not None:
            return pairing
        code = codes.normalize_user_code(id_or_user_code)
        row = conn.execute(_PENDING_BY_CODE, {"code": code, "now": time.time()}).first()
        return None if row is None else record(Pairing, row)


def decide_pairing(
    db: Database,
    pairing_id: str,
    approve: bool,
    scopes: list[str] | None = None,
    *,
    decided_by: str | None = None,
    held: frozenset[str] | None = None,
) -> tuple[Pairing | None, str]:
    """Approve (with `scopes`, a subset of those requested) or deny a pending pairing.

    `decided_by` is the deciding caller's id (the client it becomes belongs to that Jupyter
    user, or to the user of the deciding client: LMSP B12), `held` the scopes it holds when it is a paired
    client (None: the owner, who holds all). A client grants only scopes it holds and decides
    no pairing it started itself.

    Returns the pairing and "ok", or None/the pairing and why nothing changed:
    "not_found", "expired", "decided", "scopes_not_requested", "scopes_not_held",
    "self_approval".
    """
    now = time.time()
    with db.writing() as conn:
        pairing = get(conn, Pairing, pairing_id, for_update=True)
        if pairing is None:
            return None, "not_found"
        if pairing.status != "pending":
            return pairing, "decided"
        if pairing.expires_at <= now:
            return pairing, "expired"
        if held is not None and decided_by is not None and pairing.started_by == decided_by:
            return pairing, "self_approval"
        requested = json.loads(pairing.requested_scopes)
        if approve:
            granted = requested if scopes is None else scopes
            if not set(granted) <= set(requested):
                return pairing, "scopes_not_requested"
            if held is not None and not set(granted) <= held:
                return pairing, "scopes_not_held"
            pairing.granted_scopes = json.dumps(granted)
        pairing.status = "approved" if approve else "denied"
        pairing.decided_at = now
        pairing.decided_by = decided_by
        save(conn, pairing)
    return pairing, "ok"


@dataclass
class PollResult:
    outcome: str  # token | authorization_pending | slow_down | access_denied | expired_token
    #               | invalid_grant | not_found
    pairing: Pairing | None = None
    client: Client | None = None
    access_token: str | None = None


def poll_pairing(db: Database, pairing_id: str, device_code: str) -> PollResult:
    now = time.time()
    with db.writing() as conn:
        pairing = get(conn, Pairing, pairing_id, for_update=True)
        if pairing is None:
            return PollResult("not_found")
        if not codes.matches(device_code, pairing.device_code_hash):
            # Wrong codes count against the pairing: after a few, it is dead, so a guesser
            # gets MAX_FAILED_POLLS tries at a 256-bit secret.
            pairing.failed_attempts += 1
            if pairing.failed_attempts >= MAX_FAILED_POLLS and pairing.status == "pending":
                pairing.expires_at = min(pairing.expires_at, now)
            save(conn, pairing)
            return PollResult("invalid_grant", pairing)
        if pairing.status == "claimed":
            return PollResult("expired_token", pairing)
        if pairing.status == "denied":
            return PollResult("access_denied", pairing)
        if pairing.expires_at <= now:
            return PollResult("expired_token", pairing)
        if pairing.status == "pending":
            too_soon = (
                pairing.last_polled_at is not None
                and now - pairing.last_polled_at < pairing.interval
            )
            pairing.last_polled_at = now
            if too_soon:
                pairing.interval += SLOW_DOWN_STEP
            save(conn, pairing)
            return PollResult("slow_down" if too_soon else "authorization_pending", pairing)
        # approved: release the token, once
        token = codes.new_access_token()
        client = Client(
            id=f"client_{pairing.id.split('_', 1)[1]}",
            name=pairing.client_name,
            token_hash=codes.secret_hash(token),
            scopes=pairing.granted_scopes or "[]",
            created_at=now,
            approved_by=pairing.decided_by,
            paired_by=_jupyter_user_of(conn, pairing.decided_by),
        )
        # The client first: the pairing refers to it (a foreign key).
        conn.execute(_INSERT_CLIENT, client.model_dump())
        pairing.status = "claimed"
        pairing.client_id = client.id
        pairing.last_polled_at = now
        save(conn, pairing)
    return PollResult("token", pairing, client, token)


def client_for_token(db: Database, token: str) -> Client | None:
    """The live (not revoked) client whose token this is."""
    wanted = codes.secret_hash(token)
    with db.reading() as conn:
        row = conn.execute(_CLIENT_BY_TOKEN, {"wanted": wanted}).first()
    client = None if row is None else record(Client, row)
    if client is None or client.revoked_at is not None:
        return None
    if not codes.matches(token, client.token_hash):
        return None
    return client


def touch_client(db: Database, client_id: str, now: float | None = None) -> None:
    with db.writing() as conn:
        conn.execute(_TOUCH, {"client_id": client_id, "now": time.time() if now is None else now})


def list_clients(
    db: Database, include_revoked: bool = False, paired_by: str | None = None
) -> list[Client]:
    """Paired clients (only those `paired_by` approved, when given), oldest first."""
    query = select(_clients).order_by(_clients.c.created_at)
    if not include_revoked:
        query = query.where(_clients.c.revoked_at.is_(None))
    if paired_by is not None:
        query = query.where(_clients.c.paired_by == paired_by)
    with db.reading() as conn:
        return records(Client, conn.execute(query))


def clients_paired_by(db: Database, owner: str) -> frozenset[str]:
    """The ids of every client (revoked too) whose pairing `owner` approved: their tasks and
    responses are `owner`'s to see (LMSP B12)."""
    with db.reading() as conn:
        return frozenset(conn.execute(_PAIRED_BY, {"owner": owner}).scalars())


def get_client(db: Database, client_id: str) -> Client | None:
    with db.reading() as conn:
        return get(conn, Client, client_id)


def _jupyter_user_of(conn: Connection, approver: str | None) -> str | None:
    """The Jupyter user a client approved by `approver` belongs to: the approver itself, or
    the user of the approving client."""
    if approver is None or is_jupyter_owner(approver):
        return approver
    client = get(conn, Client, approver)
    return client.paired_by if client is not None else None
