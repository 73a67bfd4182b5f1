"""Webhooks on the wire (issue 38): the owner's endpoints, their deliveries, and the event sent.

The event a receiver gets is OpenAI's webhook event (`{"id": "evt_…", "object": "event",
"type": "response.completed", "created_at": …, "data": {"id": "resp_…"}}`), signed as Standard
Webhooks specifies (`webhook-id`, `webhook-timestamp`, `webhook-signature`). docs/protocol.md,
"Webhooks", says the rest.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args
from urllib.parse import urlsplit

from pydantic import BeforeValidator, Field

from .fields import Body, Query, WireObject, refuse

WebhookEventType = Literal[
    "response.completed", "response.failed", "response.cancelled", "response.incomplete"
]
WEBHOOK_EVENT_TYPES: frozenset[str] = frozenset(get_args(WebhookEventType))
DeliveryState = Literal["pending", "delivered", "dead"]

MAX_URL_LENGTH = 2048


def _url(value: Any) -> Any:
    if not isinstance(value, str) or not 1 <= len(value) <= MAX_URL_LENGTH:
        raise refuse("invalid_value", "'{param}' must be an http or https URL.")
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 (a bad port raises here)
    except ValueError:
        raise refuse("invalid_value", "'{param}' is not a valid URL.") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise refuse("invalid_value", "'{param}' must be an http or https URL with a host.")
    if parts.username is not None or parts.password is not None or parts.fragment:
        raise refuse("invalid_value", "'{param}' may hold no credentials and no fragment ('#…').")
    return value


def _events(value: Any) -> Any:
    if not isinstance(value, list) or not value or not all(isinstance(e, str) for e in value):
        raise refuse("invalid_value", "'{param}' must be a non-empty list of event types.")
    unknown = [e for e in value if e not in WEBHOOK_EVENT_TYPES]
    if unknown:
        raise refuse(
            "invalid_value",
            f"Unknown event type(s): {', '.join(unknown)}. "
            f"Known: {', '.join(sorted(WEBHOOK_EVENT_TYPES))}.",
        )
    return sorted(set(value))


# What the document says a URL is (what `_url` checks, as a pattern): http(s), a host name
# or IPv4 address without credentials, an optional port 1-65535, no fragment.
_PORT = "(6553[0-5]|655[0-2][0-9]|65[0-4][0-9]{2}|6[0-4][0-9]{3}|[1-5][0-9]{4}|[1-9][0-9]{0,3})"
URL_PATTERN = rf"^https?://[A-Za-z0-9._~-]+(:{_PORT})?([/?][^#\s]*)?$"

Url = Annotated[
    str,
    BeforeValidator(_url),
    Field(
        min_length=8,
        max_length=MAX_URL_LENGTH,
        json_schema_extra={"pattern": URL_PATTERN},
        pattern=URL_PATTERN,
        description="The http or https URL events are POSTed to (no credentials, no fragment).",
    ),
]
Events = Annotated[
    list[WebhookEventType],
    BeforeValidator(_events),
    Field(min_length=1, description="The event types this endpoint is sent."),
]
Description = Annotated[str, Field(max_length=200)]


class CreateWebhookEndpointRequest(Body):
    url: Url
    events: Events
    description: Description = ""
    enabled: bool = True


class UpdateWebhookEndpointRequest(Body):
    url: Url | None = None
    events: Events | None = None
    description: Description | None = None
    enabled: bool | None = None


class WebhookDeliveryCounts(WireObject):
    """How many of an endpoint's deliveries are in each state (`delivered` ones are purged
    after a while, see "Webhooks" in docs/protocol.md)."""

    pending: Annotated[int, Field(ge=0)] = 0
    delivered: Annotated[int, Field(ge=0)] = 0
    dead: Annotated[int, Field(ge=0)] = 0


class WebhookEndpoint(WireObject):
    """An endpoint as the owner sees it (its secret only once, when created)."""

    id: str
    object: Literal["webhook_endpoint"] = "webhook_endpoint"
    url: str
    events: list[WebhookEventType]
    description: str
    enabled: bool
    created_at: int
    updated_at: int
    deliveries: WebhookDeliveryCounts = Field(
        default_factory=WebhookDeliveryCounts,
        description="Its deliveries by state, as the endpoint is read.",
    )


class WebhookEndpointCreated(WebhookEndpoint):
    secret: str = Field(
        description="The signing secret (`whsec_` and base64), shown this once only: Standard "
        "Webhooks verifiers take it as it is."
    )


class WebhookEndpointList(WireObject):
    object: Literal["list"] = "list"
    data: list[WebhookEndpoint]


class WebhookEventData(WireObject):
    id: str = Field(description="The response's id.")


class WebhookEvent(WireObject):
    """The body POSTed to an endpoint: OpenAI's webhook event."""

    id: str = Field(description="The event's id, also sent as `webhook-id` on every attempt.")
    object: Literal["event"] = "event"
    type: WebhookEventType
    created_at: int
    data: WebhookEventData


class WebhookDelivery(WireObject):
    """One event to one endpoint: its attempts so far and its state (`dead` once the last
    allowed attempt failed; `POST …/redeliver` sends it again)."""

    id: str
    object: Literal["webhook_delivery"] = "webhook_delivery"
    endpoint_id: str
    event: WebhookEvent
    status: DeliveryState
    attempts: int
    next_attempt_at: int | None = Field(description="When a pending delivery is tried next.")
    last_status_code: int | None = Field(description="The HTTP status of the last attempt.")
    last_error: str | None = Field(description="Why the last attempt failed.")
    created_at: int
    delivered_at: int | None


class WebhookDeliveryList(WireObject):
    object: Literal["list"] = "list"
    data: list[WebhookDelivery]
    has_more: bool


class ListWebhookDeliveriesQuery(Query):
    status: DeliveryState | None = Field(None, description="Only deliveries in this state.")
    after: str | None = Field(None, description="The last delivery id of the previous page.")
    limit: Annotated[int, Field(ge=1, le=100)] = Field(20, description="Page size.")
