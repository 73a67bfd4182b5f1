"""Webhook endpoints and their outbox (issue 38): `webhook_endpoints` and `webhook_deliveries`.

An endpoint belongs to a Jupyter user (`jupyter:<name>`) and is sent the ends of that user's
responses and of the clients that user paired. `enqueue` writes one outbox row per terminal
event and endpoint that wants it, on the connection of the rule writing the event
(`rules.events.write`), so a task never ends without its deliveries on disk, nor has
deliveries for an end that rolled back.

Delivery (`services.webhooks`): `claim_due` takes pending rows whose time has come and whose
claim is free (never taken, lease run out, or its server's runner row deleted by the recovery
of a dead server: the foreign key sets `claimed_by` to NULL), locking them with `SKIP LOCKED`
on PostgreSQL, so several servers on one database never send one row at once; `record_attempt`
writes the outcome: delivered, due again later, or `dead` after the last allowed attempt.
`redeliver` puts a row back to pending with its same event id and payload.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import bindparam, delete, func, insert, or_, select, update
from sqlalchemy.engine import Connection

from ..protocol.ids import new_id
from .database import Database
from .records import get, record, records, table
from .tables import Client, WebhookDelivery, WebhookEndpoint

PENDING = "pending"
DELIVERED = "delivered"
DEAD = "dead"
STATES = (PENDING, DELIVERED, DEAD)

_ENDPOINTS = table(WebhookEndpoint)
_DELIVERIES = table(WebhookDelivery)
_CLIENTS = table(Client)

_OF_OWNER = (
    select(_ENDPOINTS)
    .where(_ENDPOINTS.c.owner == bindparam("owner"))
    .order_by(_ENDPOINTS.c.created_at, _ENDPOINTS.c.id)
)
_ENDPOINT_OF = select(_ENDPOINTS).where(
    _ENDPOINTS.c.id == bindparam("id"), _ENDPOINTS.c.owner == bindparam("owner")
)
_DELETE_ENDPOINT = delete(_ENDPOINTS).where(_ENDPOINTS.c.id == bindparam("id"))
_PAIRED_BY = select(_CLIENTS.c.id, _CLIENTS.c.paired_by).where(
    _CLIENTS.c.id.in_(bindparam("ids", expanding=True))
)
_ENABLED_OF = select(_ENDPOINTS.c.id, _ENDPOINTS.c.owner, _ENDPOINTS.c.events).where(
    _ENDPOINTS.c.owner.in_(bindparam("owners", expanding=True)), _ENDPOINTS.c.enabled.is_(True)
)
_INSERT_DELIVERY = insert(_DELIVERIES)
_DUE = (
    select(_DELIVERIES, _ENDPOINTS.c.url, _ENDPOINTS.c.secret)
    .join(_ENDPOINTS, _ENDPOINTS.c.id == _DELIVERIES.c.endpoint_id)
    .where(
        _DELIVERIES.c.state == PENDING,
        _DELIVERIES.c.next_attempt_at <= bindparam("now"),
        or_(_DELIVERIES.c.claimed_by.is_(None), _DELIVERIES.c.lease_until < bindparam("now")),
        _ENDPOINTS.c.enabled.is_(True),
        _DELIVERIES.c.endpoint_id.not_in(bindparam("busy", expanding=True)),
    )
    .order_by(_DELIVERIES.c.next_attempt_at, _DELIVERIES.c.id)
    .limit(bindparam("limit"))
    .with_for_update(of=_DELIVERIES, skip_locked=True)
)
_CLAIM = (
    update(_DELIVERIES)
    .where(_DELIVERIES.c.id == bindparam("key_id"))
    .values(
        claimed_by=bindparam("claimer"),
        lease_until=bindparam("lease_until"),
        updated_at=bindparam("now"),
    )
)
_DELIVERY_FOR_UPDATE = (
    select(_DELIVERIES).where(_DELIVERIES.c.id == bindparam("id")).with_for_update()
)
_SET = update(_DELIVERIES).where(_DELIVERIES.c.id == bindparam("key_id"))
_NEXT_DUE = select(func.min(_DELIVERIES.c.next_attempt_at)).where(_DELIVERIES.c.state == PENDING)
_BY_STATE = select(_DELIVERIES.c.state, func.count()).group_by(_DELIVERIES.c.state)
_BY_ENDPOINT_STATE = (
    select(_DELIVERIES.c.endpoint_id, _DELIVERIES.c.state, func.count())
    .join(_ENDPOINTS, _ENDPOINTS.c.id == _DELIVERIES.c.endpoint_id)
    .where(_ENDPOINTS.c.owner == bindparam("owner"))
    .group_by(_DELIVERIES.c.endpoint_id, _DELIVERIES.c.state)
)
_PURGE = delete(_DELIVERIES).where(
    _DELIVERIES.c.state == DELIVERED, _DELIVERIES.c.delivered_at < bindparam("before")
)


@dataclass
class Due:
    """A claimed delivery with what sending it needs."""

    delivery: WebhookDelivery
    url: str
    secret: str


# -- endpoints (the owner's API) -------------------------------------------------------------


def create_endpoint(db: Database, endpoint: WebhookEndpoint) -> WebhookEndpoint:
    with db.writing() as conn:
        conn.execute(insert(_ENDPOINTS), endpoint.model_dump())
    return endpoint


def list_endpoints(db: Database, owner: str) -> list[WebhookEndpoint]:
    with db.reading() as conn:
        return records(WebhookEndpoint, conn.execute(_OF_OWNER, {"owner": owner}))


def get_endpoint(db: Database, owner: str, endpoint_id: str) -> WebhookEndpoint | None:
    with db.reading() as conn:
        row = conn.execute(_ENDPOINT_OF, {"id": endpoint_id, "owner": owner}).first()
        return None if row is None else record(WebhookEndpoint, row)


def update_endpoint(
    db: Database, owner: str, endpoint_id: str, changes: dict[str, Any], now: float
) -> WebhookEndpoint | None:
    """Change an endpoint's `url`, `events`, `description` or `enabled` (those in `changes`)."""
    with db.writing() as conn:
        endpoint = get(conn, WebhookEndpoint, endpoint_id, for_update=True)
        if endpoint is None or endpoint.owner != owner:
            return None
        for name, value in changes.items():
            setattr(endpoint, name, json.dumps(value) if name == "events" else value)
        endpoint.updated_at = now
        values = {k: getattr(endpoint, k) for k in (*changes, "updated_at")}
        conn.execute(
            update(_ENDPOINTS).where(_ENDPOINTS.c.id == bindparam("key_id")),
            {**values, "key_id": endpoint_id},
        )
    return endpoint


def delete_endpoint(db: Database, owner: str, endpoint_id: str) -> WebhookEndpoint | None:
    """Delete an endpoint and, with it, its deliveries (pending ones are never sent)."""
    with db.writing() as conn:
        endpoint = get(conn, WebhookEndpoint, endpoint_id, for_update=True)
        if endpoint is None or endpoint.owner != owner:
            return None
        conn.execute(_DELETE_ENDPOINT, {"id": endpoint_id})
    return endpoint


# -- the outbox, written with the terminal event ---------------------------------------------


def enqueue(conn: Connection, ended: Sequence[tuple[str, str, dict[str, Any]]], now: float) -> int:
    """Write the deliveries of terminal events, on the connection of the transaction writing
    them: `ended` holds (the task's owner, its response id, the event). Each event goes to the
    enabled endpoints of the owner's Jupyter user that want its type, with one event id (the
    `webhook-id`) shared by its deliveries. As OpenAI's, only background responses' ends are
    sent (a foreground caller is answered with the end itself). How many rows were written."""
    ended = [e for e in ended if (e[2].get("response") or {}).get("background")]
    owners = {owner for owner, _, _ in ended}
    users = {o: o for o in owners if o.startswith("jupyter:")}
    clients = [o for o in owners if o not in users]
    if clients:
        for client_id, paired_by in conn.execute(_PAIRED_BY, {"ids": clients}):
            if paired_by:
                users[client_id] = paired_by
    if not users:
        return 0
    endpoints: dict[str, list[tuple[str, list[str]]]] = {}
    for endpoint_id, owner, events in conn.execute(
        _ENABLED_OF, {"owners": sorted(set(users.values()))}
    ):
        endpoints.setdefault(owner, []).append((endpoint_id, json.loads(events)))
    rows: list[dict[str, Any]] = []
    for owner, response_id, event in ended:
        wanted = [
            e for e, types in endpoints.get(users.get(owner, ""), []) if event["type"] in types
        ]
        if not wanted:
            continue
        event_id = new_id("evt")
        payload = json.dumps(
            {
                "id": event_id,
                "object": "event",
                "type": event["type"],
                "created_at": int(now),
                "data": {"id": response_id},
            },
            separators=(",", ":"),
        )
        for endpoint_id in wanted:
            rows.append(
                {
                    "id": new_id("whdel"),
                    "endpoint_id": endpoint_id,
                    "event_id": event_id,
                    "event_type": event["type"],
                    "response_id": response_id,
                    "payload": payload,
                    "state": PENDING,
                    "attempts": 0,
                    "next_attempt_at": now,
                    "claimed_by": None,
                    "lease_until": None,
                    "last_status": None,
                    "last_error": None,
                    "created_at": now,
                    "updated_at": now,
                    "delivered_at": None,
                }
            )
    if rows:
        conn.execute(_INSERT_DELIVERY, rows)
    return len(rows)


# -- delivery ----------------------------------------------------------------------------------


def claim_due(
    db: Database,
    claimer: str,
    limit: int,
    lease_seconds: float,
    now: float,
    in_flight: Mapping[str, int] | None = None,
    per_endpoint: int = 2,
) -> list[Due]:
    """Claim up to `limit` pending deliveries that are due and unclaimed (or whose claim ran
    out), oldest due first, for `lease_seconds`, and at most `per_endpoint` to one endpoint
    counting the `in_flight` ones (endpoint id -> deliveries the claimer is sending)."""
    counts = dict(in_flight or {})
    busy = [e for e, n in counts.items() if n >= per_endpoint]
    with db.writing() as conn:
        rows: list[Any] = []
        found = conn.execute(_DUE, {"now": now, "limit": limit * per_endpoint, "busy": busy})
        for r in found:
            if len(rows) >= limit:
                break
            if counts.get(r.endpoint_id, 0) < per_endpoint:
                counts[r.endpoint_id] = counts.get(r.endpoint_id, 0) + 1
                rows.append(r)
        if not rows:
            return []
        lease_until = now + lease_seconds
        conn.execute(
            _CLAIM,
            [
                {"key_id": r.id, "claimer": claimer, "lease_until": lease_until, "now": now}
                for r in rows
            ],
        )
    claimed = []
    for r in rows:
        values = {c.name: getattr(r, c.name) for c in _DELIVERIES.c}
        values.update(claimed_by=claimer, lease_until=lease_until, updated_at=now)
        claimed.append(Due(WebhookDelivery(**values), r.url, r.secret))
    return claimed


def record_attempt(
    db: Database,
    delivery_id: str,
    claimer: str,
    *,
    delivered: bool,
    status: int | None,
    error: str | None,
    retry_at: float,
    max_attempts: int,
    now: float,
) -> WebhookDelivery | None:
    """Write one attempt's outcome. A delivered row is `delivered` whoever holds it now (it
    was sent); a failed attempt counts only while `claimer` still holds the row, and the row
    is due again at `retry_at`, or `dead` once it had `max_attempts` attempts. None if the row
    is gone (its endpoint deleted)."""
    with db.writing() as conn:
        row = conn.execute(_DELIVERY_FOR_UPDATE, {"id": delivery_id}).first()
        if row is None:
            return None
        delivery = record(WebhookDelivery, row)
        if delivery.state != PENDING:
            return delivery
        if not delivered and delivery.claimed_by != claimer:
            return delivery  # another server took it over meanwhile: its attempt counts
        delivery.attempts += 1
        delivery.last_status = status
        delivery.last_error = error
        delivery.claimed_by = None
        delivery.lease_until = None
        delivery.updated_at = now
        if delivered:
            delivery.state = DELIVERED
            delivery.delivered_at = now
        elif delivery.attempts >= max_attempts:
            delivery.state = DEAD
        else:
            delivery.next_attempt_at = retry_at
        _save(conn, delivery)
    return delivery


def _save(conn: Connection, delivery: WebhookDelivery) -> None:
    values = delivery.model_dump()
    values["key_id"] = values.pop("id")
    conn.execute(_SET.values({k: bindparam(k) for k in values if k != "key_id"}), values)


def next_due(db: Database) -> float | None:
    """When the earliest pending delivery is due (None: nothing is pending)."""
    with db.reading() as conn:
        value = conn.execute(_NEXT_DUE).scalar()
        return None if value is None else float(value)


# -- what the owner sees ---------------------------------------------------------------------


def list_deliveries(
    db: Database,
    owner: str,
    endpoint_id: str,
    state: str | None = None,
    limit: int = 100,
    after: str | None = None,
) -> list[WebhookDelivery] | None:
    """An endpoint's deliveries, oldest first (after the delivery `after`); None if the owner
    has no such endpoint."""
    with db.reading() as conn:
        if conn.execute(_ENDPOINT_OF, {"id": endpoint_id, "owner": owner}).first() is None:
            return None
        query = select(_DELIVERIES).where(_DELIVERIES.c.endpoint_id == endpoint_id)
        if state is not None:
            query = query.where(_DELIVERIES.c.state == state)
        if after is not None:
            anchor = conn.execute(
                select(_DELIVERIES.c.created_at).where(_DELIVERIES.c.id == after)
            ).scalar()
            if anchor is not None:
                query = query.where(
                    or_(
                        _DELIVERIES.c.created_at > anchor,
                        (_DELIVERIES.c.created_at == anchor) & (_DELIVERIES.c.id > after),
                    )
                )
        query = query.order_by(_DELIVERIES.c.created_at, _DELIVERIES.c.id).limit(limit)
        return records(WebhookDelivery, conn.execute(query))


def redeliver(
    db: Database, owner: str, endpoint_id: str, delivery_id: str, now: float
) -> WebhookDelivery | None:
    """Send a delivery again (a dead one, or any other): pending at once, its attempts counted
    from zero, with its same event id and payload. None if the owner has no such delivery."""
    with db.writing() as conn:
        endpoint = get(conn, WebhookEndpoint, endpoint_id)
        row = conn.execute(_DELIVERY_FOR_UPDATE, {"id": delivery_id}).first()
        if endpoint is None or endpoint.owner != owner or row is None:
            return None
        delivery = record(WebhookDelivery, row)
        if delivery.endpoint_id != endpoint_id:
            return None
        delivery.state = PENDING
        delivery.attempts = 0
        delivery.next_attempt_at = now
        delivery.claimed_by = None
        delivery.lease_until = None
        delivery.delivered_at = None
        delivery.updated_at = now
        _save(conn, delivery)
    return delivery


def counts(db: Database) -> dict[str, int]:
    """How many deliveries are in each state (for `jupyter lmsp doctor`)."""
    with db.reading() as conn:
        found = {state: 0 for state in STATES}
        found.update({str(s): int(n) for s, n in conn.execute(_BY_STATE)})
        return found


def counts_by_endpoint(db: Database, owner: str) -> dict[str, dict[str, int]]:
    """How many deliveries of each of the owner's endpoints are in each state (for the
    endpoint objects: the sidebar shows them)."""
    found: dict[str, dict[str, int]] = {}
    with db.reading() as conn:
        for endpoint_id, state, n in conn.execute(_BY_ENDPOINT_STATE, {"owner": owner}):
            found.setdefault(str(endpoint_id), dict.fromkeys(STATES, 0))[str(state)] = int(n)
    return found


def purge_delivered(db: Database, before: float) -> int:
    """Delete deliveries delivered before `before` (retention); pending and dead ones stay."""
    with db.writing() as conn:
        return int(conn.execute(_PURGE, {"before": before}).rowcount)
