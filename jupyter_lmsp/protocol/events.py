"""Event builders: the data of every event in a task's log (LMSP B6, B10).

Builders return dicts without `sequence_number`; the store assigns it in the transaction that
appends the events. Every event carries `type`; lifecycle events carry the whole response
object, so the openai SDK's stream helper sees one response id throughout.

LMSP-only types (`response.loading`, `response.cancelling`, `response.cancelled`) follow the same
shape as the lifecycle events of the Responses API.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import ConfigDict, Field

from .fields import WireObject
from .responses import Response, function_call_item, output_message, output_text_part
from .tools import Logprob

EventData = dict[str, Any]


class Event(WireObject):
    """One event of a task's log. `sequence_number` starts at 0 and grows by exactly 1; the
    first event is `response.created`, the last exactly one terminal event
    (`response.completed`, `.incomplete`, `.failed`, `.cancelled`). Lifecycle events carry the
    whole response as `response`; text arrives as `response.output_text.delta`. Registration
    tasks' events are `task.*`."""

    model_config = ConfigDict(
        extra="allow",
        json_schema_extra=lambda schema: schema.update(required=["type", "sequence_number"]),
    )

    type: str = Field(examples=["response.created", "response.output_text.delta"])
    sequence_number: Annotated[int, Field(ge=0)]
    response: Response | None = None
    item_id: str | None = None
    output_index: Annotated[int, Field(ge=0)] | None = None
    content_index: Annotated[int, Field(ge=0)] | None = None
    delta: str | None = None
    text: str | None = None
    logprobs: list[Logprob] | None = Field(
        None, description="Text events of a response that includes log-probabilities."
    )
    arguments: str | None = Field(None, description="`response.function_call_arguments.done`.")
    choice: Annotated[int, Field(ge=0)] | None = Field(
        None,
        description="LMSP: which choice an item event belongs to, for a chat completion with "
        "`n` > 1 (absent otherwise).",
    )


CREATED = "response.created"
QUEUED = "response.queued"
LOADING = "response.loading"
IN_PROGRESS = "response.in_progress"
CANCELLING = "response.cancelling"
ITEM_ADDED = "response.output_item.added"
PART_ADDED = "response.content_part.added"
TEXT_DELTA = "response.output_text.delta"
TEXT_DONE = "response.output_text.done"
PART_DONE = "response.content_part.done"
ITEM_DONE = "response.output_item.done"
ARGUMENTS_DELTA = "response.function_call_arguments.delta"
ARGUMENTS_DONE = "response.function_call_arguments.done"
COMPLETED = "response.completed"
INCOMPLETE = "response.incomplete"
FAILED = "response.failed"
CANCELLED = "response.cancelled"

TERMINAL_EVENT_TYPES = frozenset(
    {COMPLETED, INCOMPLETE, FAILED, CANCELLED, "task.completed", "task.failed", "task.cancelled"}
)


def is_terminal(event: EventData) -> bool:
    """Whether `event` is the last one of its task's log."""
    return event["type"] in TERMINAL_EVENT_TYPES


def lifecycle(type_: str, response: dict[str, Any]) -> EventData:
    return {"type": type_, "response": response}


def item_opened(item_id: str, output_index: int) -> list[EventData]:
    return [
        {
            "type": ITEM_ADDED,
            "output_index": output_index,
            "item": {
                "id": item_id,
                "type": "message",
                "role": "assistant",
                "status": "in_progress",
                "content": [],
            },
        },
        {
            "type": PART_ADDED,
            "item_id": item_id,
            "output_index": output_index,
            "content_index": 0,
            "part": output_text_part(""),
        },
    ]


def text_delta(
    item_id: str, output_index: int, delta: str, logprobs: list[dict[str, Any]] | None = None
) -> EventData:
    return {
        "type": TEXT_DELTA,
        "item_id": item_id,
        "output_index": output_index,
        "content_index": 0,
        "delta": delta,
        "logprobs": list(logprobs or []),
    }


def item_closed(
    item_id: str,
    output_index: int,
    text: str,
    status: str,
    logprobs: list[dict[str, Any]] | None = None,
) -> list[EventData]:
    return [
        {
            "type": TEXT_DONE,
            "item_id": item_id,
            "output_index": output_index,
            "content_index": 0,
            "text": text,
            "logprobs": list(logprobs or []),
        },
        {
            "type": PART_DONE,
            "item_id": item_id,
            "output_index": output_index,
            "content_index": 0,
            "part": output_text_part(text, logprobs),
        },
        {
            "type": ITEM_DONE,
            "output_index": output_index,
            "item": output_message(item_id, text, status, logprobs),
        },
    ]


def call_opened(item_id: str, call_id: str, output_index: int, name: str) -> EventData:
    return {
        "type": ITEM_ADDED,
        "output_index": output_index,
        "item": function_call_item(item_id, call_id, name, "", "in_progress"),
    }


def call_arguments(item_id: str, output_index: int, delta: str) -> EventData:
    return {
        "type": ARGUMENTS_DELTA,
        "item_id": item_id,
        "output_index": output_index,
        "delta": delta,
    }


def call_closed(
    item_id: str, call_id: str, output_index: int, name: str, arguments: str, status: str
) -> list[EventData]:
    """The end of a function call item: its arguments (when it completed), then the item."""
    done: list[EventData] = []
    if status == "completed":
        done.append(
            {
                "type": ARGUMENTS_DONE,
                "item_id": item_id,
                "output_index": output_index,
                "arguments": arguments,
            }
        )
    done.append(
        {
            "type": ITEM_DONE,
            "output_index": output_index,
            "item": function_call_item(item_id, call_id, name, arguments, status),
        }
    )
    return done
