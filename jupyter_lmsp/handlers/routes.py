"""The URL table of `lmsp/v1/` (Jupyter Server prepends its base_url)."""

from __future__ import annotations

from typing import Any

from ..services.context import ServiceContext
from .chat import ChatCompletionsHandler
from .fallback import FallbackHandler
from .openapi import OpenAPIHandler
from .pairing import (
    ClientHandler,
    ClientsHandler,
    PairingDecisionHandler,
    PairingsHandler,
    PairingTokenHandler,
)
from .responses import (
    ResponseCancelHandler,
    ResponseHandler,
    ResponseInputItemsHandler,
    ResponsesHandler,
)
from .service import ModelHandler, ModelsHandler, ServiceHandler
from .tasks import TaskCancelHandler, TaskEventsHandler, TaskHandler, TasksHandler

PREFIX = "/lmsp/v1"
ID = r"([A-Za-z0-9_\-.]+)"


def routes(ctx: ServiceContext) -> list[tuple[str, Any, dict[str, Any]]]:
    table = [
        ("/service", ServiceHandler),
        ("/models", ModelsHandler),
        (f"/models/{ID}", ModelHandler),
        ("/responses", ResponsesHandler),
        (f"/responses/{ID}", ResponseHandler),
        (f"/responses/{ID}/cancel", ResponseCancelHandler),
        (f"/responses/{ID}/input_items", ResponseInputItemsHandler),
        ("/tasks", TasksHandler),
        (f"/tasks/{ID}", TaskHandler),
        (f"/tasks/{ID}/cancel", TaskCancelHandler),
        (f"/tasks/{ID}/events", TaskEventsHandler),
        ("/pairings", PairingsHandler),
        (f"/pairings/{ID}/(approve|deny)", PairingDecisionHandler),
        (f"/pairings/{ID}/token", PairingTokenHandler),
        ("/clients", ClientsHandler),
        (f"/clients/{ID}", ClientHandler),
        ("/chat/completions", ChatCompletionsHandler),
        ("/openapi.json", OpenAPIHandler),
        # Last: whatever no route above matches (an unknown path, a malformed id).
        ("/.*", FallbackHandler),
    ]
    return [(PREFIX + path, handler, {"ctx": ctx}) for path, handler in table]
