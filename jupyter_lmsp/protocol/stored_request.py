"""How a response's request is stored: its conversation once, in the response's `request`
(`conversation`: the earlier turns and this request's input; `input_count`: how many of the
last messages are this request's input; `instructions` apart). Rows written before this layout
kept the messages in the task's `params` (`messages`, `context`, `input_messages`); their
readers fall back to those (`services.conversation`, `protocol.excerpt`).
"""

from __future__ import annotations

from typing import Any


def own_input(request: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The messages of the request's own input (the last `input_count` of its conversation);
    None for a row of the older layout (no `conversation` in its request)."""
    if "conversation" not in request:
        return None
    count = int(request.get("input_count", 0))
    return list(request["conversation"])[-count:] if count else []
