"""`/lmsp/v1/webhooks`: the owner's webhook endpoints, their deliveries, redelivery (issue 38).

The owner only (`services.webhooks.require_owner`): paired clients get `403 owner_only`
whatever their scopes. Creating an endpoint takes no `Idempotency-Key`: its result holds the
signing secret, which must never be stored to be replayed.
"""

from __future__ import annotations

from ..protocol.operations import Reply
from ..protocol.webhooks import (
    CreateWebhookEndpointRequest,
    ListWebhookDeliveriesQuery,
    UpdateWebhookEndpointRequest,
    WebhookDelivery,
    WebhookDeliveryList,
    WebhookEndpoint,
    WebhookEndpointCreated,
    WebhookEndpointList,
)
from ..services import webhooks
from .base import LMSPHandler, operation

_OWNER = "The owner only (a Jupyter user); a paired client gets 403 `owner_only`."


class WebhooksHandler(LMSPHandler):
    @operation(
        "createWebhookEndpoint",
        "Register a webhook endpoint (its signing secret is shown in this answer only)",
        "webhooks",
        access="authenticated",
        replies={201: Reply("The endpoint, with its secret.", WebhookEndpointCreated)},
        errors=(403,),
        description=_OWNER + " No `Idempotency-Key`: the answer holds the secret.",
    )
    async def post(self, body: CreateWebhookEndpointRequest) -> None:
        created = await self.call(webhooks.create_endpoint, self.ctx.db, self.caller, body)
        self.write_json(created.wire(), 201)

    @operation(
        "listWebhookEndpoints",
        "The owner's webhook endpoints",
        "webhooks",
        access="authenticated",
        replies={200: Reply("The endpoints.", WebhookEndpointList)},
        errors=(403,),
        description=_OWNER,
    )
    async def get(self) -> None:
        found = await self.call(webhooks.list_endpoints, self.ctx.db, self.caller)
        self.write_json(found.wire())


class WebhookHandler(LMSPHandler):
    @operation(
        "getWebhookEndpoint",
        "One webhook endpoint",
        "webhooks",
        access="authenticated",
        replies={200: Reply("The endpoint.", WebhookEndpoint)},
        errors=(403, 404),
        description=_OWNER,
    )
    async def get(self, endpoint_id: str) -> None:
        found = await self.call(webhooks.get_endpoint, self.ctx.db, self.caller, endpoint_id)
        self.write_json(found.wire())

    @operation(
        "updateWebhookEndpoint",
        "Change a webhook endpoint's URL, events, description or enabled flag",
        "webhooks",
        access="authenticated",
        replies={200: Reply("The endpoint as changed.", WebhookEndpoint)},
        errors=(403, 404),
        idempotent=True,
        description=_OWNER,
    )
    async def post(self, endpoint_id: str, body: UpdateWebhookEndpointRequest) -> None:
        found = await self.call(
            webhooks.update_endpoint, self.ctx.db, self.caller, endpoint_id, body
        )
        self.write_json(found.wire())

    @operation(
        "deleteWebhookEndpoint",
        "Delete a webhook endpoint and its deliveries",
        "webhooks",
        access="authenticated",
        replies={200: Reply("The endpoint, deleted.", WebhookEndpoint)},
        errors=(403, 404),
        description=_OWNER,
    )
    async def delete(self, endpoint_id: str) -> None:
        found = await self.call(webhooks.delete_endpoint, self.ctx.db, self.caller, endpoint_id)
        self.write_json(found.wire())


class WebhookDeliveriesHandler(LMSPHandler):
    @operation(
        "listWebhookDeliveries",
        "An endpoint's deliveries, oldest first (`status=dead`: the dead letters)",
        "webhooks",
        access="authenticated",
        replies={200: Reply("A page of deliveries.", WebhookDeliveryList)},
        errors=(403, 404),
        description=_OWNER,
    )
    async def get(self, endpoint_id: str, query: ListWebhookDeliveriesQuery) -> None:
        found = await self.call(
            webhooks.list_deliveries, self.ctx.db, self.caller, endpoint_id, query
        )
        self.write_json(found.wire())


class WebhookRedeliverHandler(LMSPHandler):
    @operation(
        "redeliverWebhook",
        "Send a delivery again (a dead one included), with its same webhook-id and body",
        "webhooks",
        access="authenticated",
        replies={200: Reply("The delivery, pending again.", WebhookDelivery)},
        errors=(403, 404),
        idempotent=True,
        description=_OWNER,
    )
    async def post(self, endpoint_id: str, delivery_id: str) -> None:
        delivery = await self.call(
            webhooks.redeliver, self.ctx.db, self.caller, endpoint_id, delivery_id
        )
        if self.ctx.webhooks is not None:
            self.ctx.webhooks.wake()
        self.write_json(delivery.wire())
