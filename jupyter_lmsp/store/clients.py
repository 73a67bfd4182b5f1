"""Paired clients and pairing requests (the `clients` table of 11.1, and `pairings`).

Every function is one transaction. Polling for a token (`poll_pairing`) checks the device
code, the state, the expiry and the polling interval and, when the owner approved, creates the
client and marks the pairing claimed, all in one transaction: a token is released exactly once.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from sqlalchemy import select
from sqlmodel import Session, col

from ..auth import secrets as codes
from ..auth.identity import is_jupyter_owner
from .database import Database
from .tables import Client, Pairing

MAX_FAILED_POLLS = 5
SLOW_DOWN_STEP = 5


def create_pairing(db: Database, pairing: Pairing, max_pending: int | None = None) -> float | None:
    """Store a new pairing request, unless `max_pending` unexpired requests already wait: then
    nothing is stored and the time the oldest of them expires is returned (None on success).
    Counting and inserting share the transaction, so concurrent starts cannot overshoot."""
    with db.write() as session:
        if max_pending is not None:
            waiting = (
                select(col(Pairing.expires_at))
                .where(
                    col(Pairing.status) == "pending",
                    col(Pairing.expires_at) > pairing.created_at,
                )
                .order_by(col(Pairing.expires_at))
            )
            expiries = list(session.execute(waiting).scalars())
            if len(expiries) >= max_pending:
                return expiries[0]
        session.add(pairing)
    return None


def get_pairing(db: Database, pairing_id: str) -> Pairing | None:
    with db.read() as session:
        return session.get(Pairing, pairing_id)


def list_pairings(db: Database, status: str | None = "pending") -> list[Pairing]:
    """Pairing requests, oldest first (a flood of new ones never pushes an earlier one down)."""
    now = time.time()
    with db.read() as session:
        query = select(Pairing).order_by(col(Pairing.created_at))
        if status is not None:
            query = query.where(col(Pairing.status) == status)
        if status == "pending":
            query = query.where(col(Pairing.expires_at) > now)
        return list(session.execute(query).scalars())


def find_pairing(db: Database, id_or_user_code: str) -> Pairing | None:
    with db.read() as session:
        pairing = session.get(Pairing, id_or_user_code)
        if pairing is not None:
            return pairing
        code = codes.normalize_user_code(id_or_user_code)
        query = select(Pairing).where(
            col(Pairing.user_code) == code,
            col(Pairing.status) == "pending",
            col(Pairing.expires_at) > time.time(),
        )
        return session.execute(query).scalars().first()


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
    with db.write() as session:
        pairing = session.get(Pairing, pairing_id)
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
        session.add(pairing)
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
    with db.write() as session:
        pairing = session.get(Pairing, pairing_id)
        if pairing is None:
            return PollResult("not_found")
        if not codes.matches(device_code, pairing.device_code_hash):
            # Wrong codes count against the pairing: after a few, it is dead, so a guesser
            # gets MAX_FAILED_POLLS tries at a 256-bit secret.
            pairing.failed_attempts += 1
            if pairing.failed_attempts >= MAX_FAILED_POLLS and pairing.status == "pending":
                pairing.expires_at = min(pairing.expires_at, now)
            session.add(pairing)
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
            session.add(pairing)
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
            paired_by=_jupyter_user_of(session, pairing.decided_by),
        )
        session.add(client)
        pairing.status = "claimed"
        pairing.client_id = client.id
        pairing.last_polled_at = now
        session.add(pairing)
    return PollResult("token", pairing, client, token)


def client_for_token(db: Database, token: str) -> Client | None:
    """The live (not revoked) client whose token this is."""
    wanted = codes.secret_hash(token)
    with db.read() as session:
        query = select(Client).where(col(Client.token_hash) == wanted)
        client = session.execute(query).scalars().first()
    if client is None or client.revoked_at is not None:
        return None
    if not codes.matches(token, client.token_hash):
        return None
    return client


def touch_client(db: Database, client_id: str, now: float | None = None) -> None:
    with db.write() as session:
        client = session.get(Client, client_id)
        if client is not None:
            client.last_used_at = time.time() if now is None else now
            session.add(client)


def list_clients(
    db: Database, include_revoked: bool = False, paired_by: str | None = None
) -> list[Client]:
    """Paired clients (only those `paired_by` approved, when given), oldest first."""
    with db.read() as session:
        query = select(Client).order_by(col(Client.created_at))
        if not include_revoked:
            query = query.where(col(Client.revoked_at).is_(None))
        if paired_by is not None:
            query = query.where(col(Client.paired_by) == paired_by)
        return list(session.execute(query).scalars())


def clients_paired_by(db: Database, owner: str) -> frozenset[str]:
    """The ids of every client (revoked too) whose pairing `owner` approved: their tasks and
    responses are `owner`'s to see (LMSP B12)."""
    with db.read() as session:
        query = select(col(Client.id)).where(col(Client.paired_by) == owner)
        return frozenset(session.execute(query).scalars())


def get_client(db: Database, client_id: str) -> Client | None:
    with db.read() as session:
        return session.get(Client, client_id)


def _jupyter_user_of(session: Session, approver: str | None) -> str | None:
    """The Jupyter user a client approved by `approver` belongs to: the approver itself, or
    the user of the approving client."""
    if approver is None or is_jupyter_owner(approver):
        return approver
    client = session.get(Client, approver)
    return client.paired_by if client is not None else None
