"""The URL table of `lmsp/v1/` (Jupyter Server prepends its base_url).

Each path is a template (`/responses/{response_id}`) with one handler; the handler's methods
declare their operations (handlers/base.py `operation`). The Tornado routes and the OpenAPI
document's endpoints are both made from this table.
"""

from __future__ import annotations

import re
from typing import Any

from tornado import web

from ..protocol.fields import ID_PATTERN
from ..protocol.operations import Endpoint
from ..services.context import ServiceContext
from .base import LMSPHandler, operation_of
from .chat import ChatCompletionsHandler
from .conversations import (
    ConversationHandler,
    ConversationItemHandler,
    ConversationItemsHandler,
    ConversationsHandler,
)
from .embeddings import EmbeddingsHandler
from .fallback import FallbackHandler
from .metrics import MetricsHandler
from .openapi import OpenAPIHandler
from .pairing import (
    ClientHandler,
    ClientsHandler,
    PairingApproveHandler,
    PairingDenyHandler,
    PairingsHandler,
    PairingTokenHandler,
)
from .residency import ModelLoadHandler, ModelUnloadHandler
from .responses import (
    ResponseCancelHandler,
    ResponseCompactHandler,
    ResponseHandler,
    ResponseInputItemsHandler,
    ResponseInputTokensHandler,
    ResponsesHandler,
)
from .service import ModelHandler, ModelsHandler, ServiceHandler
from .tasks import (
    LifecycleHandler,
    TaskCancelHandler,
    TaskEventsHandler,
    TaskHandler,
    TasksHandler,
)
from .webhooks import (
    WebhookDeliveriesHandler,
    WebhookHandler,
    WebhookRedeliverHandler,
    WebhooksHandler,
)
from .websocket import document_extension

PREFIX = "/lmsp/v1"
METHODS = ("get", "post", "put", "patch", "delete")

TABLE: list[tuple[str, type[LMSPHandler]]] = [
    ("/service", ServiceHandler),
    ("/models", ModelsHandler),
    ("/models/{model_id}", ModelHandler),
    ("/models/{model_id}/load", ModelLoadHandler),
    ("/models/{model_id}/unload", ModelUnloadHandler),
    ("/responses", ResponsesHandler),
    # Before `/responses/{response_id}`, whose pattern would take the name as an id.
    ("/responses/compact", ResponseCompactHandler),
    ("/responses/input_tokens", ResponseInputTokensHandler),
    ("/responses/{response_id}", ResponseHandler),
    ("/responses/{response_id}/cancel", ResponseCancelHandler),
    ("/responses/{response_id}/input_items", ResponseInputItemsHandler),
    ("/conversations", ConversationsHandler),
    ("/conversations/{conversation_id}", ConversationHandler),
    ("/conversations/{conversation_id}/items", ConversationItemsHandler),
    ("/conversations/{conversation_id}/items/{item_id}", ConversationItemHandler),
    ("/tasks", TasksHandler),
    ("/tasks/{task_id}", TaskHandler),
    ("/tasks/{task_id}/cancel", TaskCancelHandler),
    ("/tasks/{task_id}/events", TaskEventsHandler),
    ("/lifecycle", LifecycleHandler),
    ("/pairings", PairingsHandler),
    ("/pairings/{pairing_id}/approve", PairingApproveHandler),
    ("/pairings/{pairing_id}/deny", PairingDenyHandler),
    ("/pairings/{pairing_id}/token", PairingTokenHandler),
    ("/clients", ClientsHandler),
    ("/clients/{client_id}", ClientHandler),
    ("/chat/completions", ChatCompletionsHandler),
    ("/webhooks", WebhooksHandler),
    ("/webhooks/{endpoint_id}", WebhookHandler),
    ("/webhooks/{endpoint_id}/deliveries", WebhookDeliveriesHandler),
    ("/webhooks/{endpoint_id}/deliveries/{delivery_id}/redeliver", WebhookRedeliverHandler),
    ("/embeddings", EmbeddingsHandler),
    ("/openapi.json", OpenAPIHandler),
    ("/metrics", MetricsHandler),
]

# An id in a path: the characters ids have (protocol.fields.ID_PATTERN).
_ID = "(" + ID_PATTERN.strip("^$") + ")"


def _pattern(template: str) -> str:
    return re.sub(r"\{\w+\}", lambda _: _ID, template)


def routes(ctx: ServiceContext) -> list[tuple[str, Any, dict[str, Any]]]:
    table: list[tuple[str, type[web.RequestHandler]]] = [
        (_pattern(path), handler) for path, handler in TABLE
    ]
    # Last: whatever no route above matches (an unknown path, a malformed id).
    table.append(("/.*", FallbackHandler))
    return [(PREFIX + path, handler, {"ctx": ctx}) for path, handler in table]


def endpoints() -> list[Endpoint]:
    """Every operation of the table, for the OpenAPI document."""
    found = []
    for path, handler in TABLE:
        for method in METHODS:
            op = operation_of(getattr(handler, method, None))
            if op is not None:
                found.append(Endpoint(path, method, op))
    return found


def path_extensions() -> dict[str, dict[str, Any]]:
    """What the document states of the table beyond its operations: the WebSocket mode of
    `/responses`, as the Open Responses spec states it."""
    return {"/responses": {"x-openresponses-websocket": document_extension()}}
