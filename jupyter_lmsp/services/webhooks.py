"""The owner's webhook endpoints and their deliveries (issue 38): the operations behind
`/lmsp/v1/webhooks`.

Only the owner (a Jupyter user) registers, reads and changes endpoints, and only its own: a
paired client is refused whatever its scopes (`403 owner_only`), since an endpoint makes the
service call a URL of its choosing. The secret is made here, returned by `create_endpoint`
once, and never shown again. Plain functions, run on a database thread by the handlers.
"""

from __future__ import annotations

import json
import time
from typing import Any

from ..auth.scopes import Caller
from ..protocol import webhooks as wire
from ..protocol.errors import LMSPError, not_found
from ..protocol.ids import new_id
from ..store import tables
from ..store import webhooks as store
from ..store.database import Database
from .webhook_delivery import new_secret


def require_owner(caller: Caller) -> None:
    if not caller.is_owner:
        raise LMSPError(
            403,
            "owner_only",
            "Only the owner (the Jupyter user) manages webhooks; paired clients never do.",
            type="permission_error",
        )


def endpoint_object(
    endpoint: tables.WebhookEndpoint, counts: dict[str, int] | None = None
) -> wire.WebhookEndpoint:
    return wire.WebhookEndpoint(
        deliveries=wire.WebhookDeliveryCounts(**(counts or {})),
        id=endpoint.id,
        url=endpoint.url,
        events=json.loads(endpoint.events),
        description=endpoint.description,
        enabled=endpoint.enabled,
        created_at=int(endpoint.created_at),
        updated_at=int(endpoint.updated_at),
    )


def delivery_object(delivery: tables.WebhookDelivery) -> wire.WebhookDelivery:
    pending = delivery.state == store.PENDING
    return wire.WebhookDelivery(
        id=delivery.id,
        endpoint_id=delivery.endpoint_id,
        event=wire.WebhookEvent.model_validate_json(delivery.payload),
        status=delivery.state,
        attempts=delivery.attempts,
        next_attempt_at=int(delivery.next_attempt_at) if pending else None,
        last_status_code=delivery.last_status,
        last_error=delivery.last_error,
        created_at=int(delivery.created_at),
        delivered_at=None if delivery.delivered_at is None else int(delivery.delivered_at),
    )


def create_endpoint(
    db: Database, caller: Caller, body: wire.CreateWebhookEndpointRequest
) -> wire.WebhookEndpointCreated:
    require_owner(caller)
    now = time.time()
    endpoint = tables.WebhookEndpoint(
        id=new_id("whep"),
        owner=caller.id,
        url=body.url,
        events=json.dumps(list(body.events)),
        secret=new_secret(),
        description=body.description,
        enabled=body.enabled,
        created_at=now,
        updated_at=now,
    )
    store.create_endpoint(db, endpoint)
    shown = endpoint_object(endpoint).model_dump()
    return wire.WebhookEndpointCreated(**shown, secret=endpoint.secret)


def list_endpoints(db: Database, caller: Caller) -> wire.WebhookEndpointList:
    require_owner(caller)
    counts = store.counts_by_endpoint(db, caller.id)
    return wire.WebhookEndpointList(
        data=[endpoint_object(e, counts.get(e.id)) for e in store.list_endpoints(db, caller.id)]
    )


def _missing(endpoint_id: str) -> LMSPError:
    return not_found("webhook endpoint", endpoint_id, param="endpoint_id")


def get_endpoint(db: Database, caller: Caller, endpoint_id: str) -> wire.WebhookEndpoint:
    require_owner(caller)
    endpoint = store.get_endpoint(db, caller.id, endpoint_id)
    if endpoint is None:
        raise _missing(endpoint_id)
    return endpoint_object(endpoint, store.counts_by_endpoint(db, caller.id).get(endpoint.id))


def update_endpoint(
    db: Database, caller: Caller, endpoint_id: str, body: wire.UpdateWebhookEndpointRequest
) -> wire.WebhookEndpoint:
    require_owner(caller)
    changes: dict[str, Any] = body.model_dump(exclude_none=True)
    if "events" in changes:
        changes["events"] = list(changes["events"])
    endpoint = store.update_endpoint(db, caller.id, endpoint_id, changes, time.time())
    if endpoint is None:
        raise _missing(endpoint_id)
    return endpoint_object(endpoint)


def delete_endpoint(db: Database, caller: Caller, endpoint_id: str) -> wire.WebhookEndpoint:
    require_owner(caller)
    endpoint = store.delete_endpoint(db, caller.id, endpoint_id)
    if endpoint is None:
        raise _missing(endpoint_id)
    return endpoint_object(endpoint)


def list_deliveries(
    db: Database, caller: Caller, endpoint_id: str, query: wire.ListWebhookDeliveriesQuery
) -> wire.WebhookDeliveryList:
    require_owner(caller)
    found = store.list_deliveries(
        db, caller.id, endpoint_id, query.status, query.limit + 1, query.after
    )
    if found is None:
        raise _missing(endpoint_id)
    return wire.WebhookDeliveryList(
        data=[delivery_object(d) for d in found[: query.limit]],
        has_more=len(found) > query.limit,
    )


def redeliver(
    db: Database, caller: Caller, endpoint_id: str, delivery_id: str
) -> wire.WebhookDelivery:
    require_owner(caller)
    delivery = store.redeliver(db, caller.id, endpoint_id, delivery_id, time.time())
    if delivery is None:
        raise not_found("webhook delivery", delivery_id, param="delivery_id")
    return delivery_object(delivery)
