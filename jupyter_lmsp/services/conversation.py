"""Where a response's conversation is stored, and how its prompt is rebuilt from it.

A response stores its conversation once, in its `request` (`conversation`: the earlier turns
and this request's input; `input_count`: how many of the last messages are this request's
input; `instructions` apart). The task's `params` hold only how to generate. Rows written
before this layout kept the messages in the task's `params` (`messages`, `context`,
`input_messages`, four copies of the input in all); they are still read.
"""

from __future__ import annotations

import json

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
    request = json.loads(response.request)
    if "conversation" in request:
        count = request.get("input_count", 0)
        return list(request["conversation"][-count:]) if count else []
    return list(json.loads(task.params).get("input_messages", []))
