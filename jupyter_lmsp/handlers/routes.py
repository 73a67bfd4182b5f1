"""The URL table of `lmsp/v1/` (Jupyter Server prepends its base_url)."""

from __future__ import annotations

from typing import Any

from ..services.context import ServiceContext
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
    ]
    return [(PREFIX + path, handler, {"ctx": ctx}) for path, handler in table]
