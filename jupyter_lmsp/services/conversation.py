"""How a stored response's prompt, conversation and own input are rebuilt from its row (the
layout: `protocol.stored_request`). The task's `params` hold only how to generate; rows written
before the layout kept the messages there (four copies of the input in all), and are still read.
"""

from __future__ import annotations

import json

from ..protocol.stored_request import own_input
from ..store.tables import Response, Task


def prompt_messages(
    instructions: str | None, conversation: list[dict[str, str]]
) -> list[dict[str, str]]:
    """What the model is given: the instructions as a system message, then the conversation."""
    head = [{"role": "system", "content": instructions}] if instructions else []
    return head + list(conversation)


def stored_messages(response: Response, task: Task) -> list[dict[str, str]]:
    """The prompt of a stored response (also from rows written before the conversation moved
    into the response's `request`)."""
    request = json.loads(response.request)
    if "conversation" in request:
        return prompt_messages(request.get("instructions"), request["conversation"])
    return list(json.loads(task.params)["messages"])


def conversation_of(response: Response, task: Task) -> list[dict[str, str]]:
    request = json.loads(response.request)
    if "conversation" in request:
        return list(request["conversation"])
    params = json.loads(task.params)
    return list(params.get("context", params.get("messages", [])))


def input_messages_of(response: Response, task: Task) -> list[dict[str, str]]:
    own = own_input(json.loads(response.request))
    if own is not None:
        return own
    return list(json.loads(task.params).get("input_messages", []))
