"""The events of a task's log (LMSP B6, B10): one model per event type, and their builders.

`Event` is the union of every event the service appends, discriminated on `type`; the OpenAPI
document describes it as such (`oneOf` with a `discriminator`), so the sidebar's generated
TypeScript narrows on `type` too. The models describe and check; the builders below return
plain dicts (the store numbers and writes them on the hot path, where building a model per
token would cost), and tests/test_event_models.py validates every builder's output against the
union, so a builder cannot emit what the document does not say.

Builders return dicts without `sequence_number`; the store assigns it in the transaction that
appends the events. Lifecycle events carry the whole response object, so the openai SDK's
stream helper sees one response id throughout. LMSP-only types (`response.loading`,
`response.cancelling`, `response.cancelled`) follow the same shape as the lifecycle events of
the Responses API. Model registrations' tasks log `task.*` events. Which events move a task to
which state is `states.EVENT_STATES`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

from pydantic import Field, RootModel

from .fields import WireObject, optional_on_wire
from .response_object import ReasoningText
from .responses import (
    OutputItem,
    OutputText,
    Response,
    TaskError,
    custom_tool_call_item,
    function_call_item,
    output_message,
    output_text_part,
    reasoning_item,
)
from .states import TERMINAL_EVENT_TYPES
from .tools import Logprob

EventData = dict[str, Any]

Index = Annotated[int, Field(ge=0)]


class _Event(WireObject):
    sequence_number: Index


# -- a response's lifecycle: the whole response object ---------------------------------------


class _Lifecycle(_Event):
    response: Response


class ResponseCreatedEvent(_Lifecycle):
    """The first event of a response's log (sequence 0): the task is `queued`."""

    type: Literal["response.created"]


class ResponseQueuedEvent(_Lifecycle):
    """Queued again at recovery (restart policy `retry`): a new attempt follows."""

    type: Literal["response.queued"]


class ResponseLoadingEvent(_Lifecycle):
    """LMSP: the task's model is being loaded (`loading`)."""

    type: Literal["response.loading"]


class ResponseInProgressEvent(_Lifecycle):
    type: Literal["response.in_progress"]


class ResponseCancellingEvent(_Lifecycle):
    """LMSP: a cancel was accepted; the task ends `cancelled`."""

    type: Literal["response.cancelling"]


class ResponseCompletedEvent(_Lifecycle):
    type: Literal["response.completed"]


class ResponseIncompleteEvent(_Lifecycle):
    type: Literal["response.incomplete"]


class ResponseFailedEvent(_Lifecycle):
    type: Literal["response.failed"]


class ResponseCancelledEvent(_Lifecycle):
    """LMSP: the task ended cancelled (the text produced so far stays in `output`)."""

    type: Literal["response.cancelled"]


# -- a response's output items ---------------------------------------------------------------


class _ItemEvent(_Event):
    """An event of one output item (`output_index`)."""

    model_config = {"json_schema_extra": optional_on_wire("choice")}

    output_index: Index
    choice: Index = Field(
        0,
        description="LMSP: which choice an item event belongs to, for a chat completion with "
        "`n` > 1 (absent otherwise).",
    )


class ResponseOutputItemAddedEvent(_ItemEvent):
    type: Literal["response.output_item.added"]
    item: OutputItem


class ResponseOutputItemDoneEvent(_ItemEvent):
    type: Literal["response.output_item.done"]
    item: OutputItem


class _PartEvent(_ItemEvent):
    item_id: str
    content_index: Index


class ResponseContentPartAddedEvent(_PartEvent):
    type: Literal["response.content_part.added"]
    part: Annotated[OutputText | ReasoningText, Field(discriminator="type")]


class ResponseContentPartDoneEvent(_PartEvent):
    type: Literal["response.content_part.done"]
    part: Annotated[OutputText | ReasoningText, Field(discriminator="type")]


class ResponseOutputTextDeltaEvent(_PartEvent):
    """More text of a message: one per committed batch."""

    type: Literal["response.output_text.delta"]
    delta: str
    logprobs: list[Logprob] = Field(
        description="The delta's tokens' log-probabilities, when the response includes them "
        "(empty otherwise)."
    )


class ResponseOutputTextDoneEvent(_PartEvent):
    type: Literal["response.output_text.done"]
    text: str
    logprobs: list[Logprob] = Field(
        description="The message's log-probabilities, when the response includes them."
    )


class ResponseReasoningTextDeltaEvent(_PartEvent):
    """More of a reasoning item's thinking: one per committed batch."""

    type: Literal["response.reasoning_text.delta"]
    delta: str


class ResponseReasoningTextDoneEvent(_PartEvent):
    type: Literal["response.reasoning_text.done"]
    text: str


class ResponseFunctionCallArgumentsDeltaEvent(_ItemEvent):
    type: Literal["response.function_call_arguments.delta"]
    item_id: str
    delta: str


class ResponseFunctionCallArgumentsDoneEvent(_ItemEvent):
    type: Literal["response.function_call_arguments.done"]
    item_id: str
    arguments: str


class ResponseCustomToolCallInputDeltaEvent(_ItemEvent):
    """More of a custom tool call's input text: one per committed batch."""

    type: Literal["response.custom_tool_call_input.delta"]
    item_id: str
    delta: str


class ResponseCustomToolCallInputDoneEvent(_ItemEvent):
    type: Literal["response.custom_tool_call_input.done"]
    item_id: str
    input: str


# -- a model registration's task -------------------------------------------------------------


class _TaskEvent(_Event):
    task_id: Annotated[str, Field(pattern="^task_")]


class TaskCreatedEvent(_TaskEvent):
    type: Literal["task.created"]


class TaskQueuedEvent(_TaskEvent):
    type: Literal["task.queued"]


class TaskLoadingEvent(_TaskEvent):
    type: Literal["task.loading"]


class TaskRunningEvent(_TaskEvent):
    type: Literal["task.running"]


class TaskProgressEvent(_TaskEvent):
    """How far a registration got: `stage` (downloading, converting, hashing, …) and its
    `fraction`; a download (`stage: downloading`) also says its bytes and files done."""

    type: Literal["task.progress"]
    stage: str
    fraction: Annotated[float, Field(ge=0, le=1)]
    bytes_done: Annotated[int, Field(ge=0)] | None = Field(
        None, description="A download's bytes on disk (kept across a restart)."
    )
    bytes_total: Annotated[int, Field(ge=0)] | None = Field(
        None, description="A download's bytes in all, as the hub lists its files."
    )
    files_done: Annotated[int, Field(ge=0)] | None = None
    files_total: Annotated[int, Field(ge=0)] | None = None
    bytes_per_second: Annotated[float, Field(ge=0)] | None = Field(
        None, description="What this attempt of the download received, per second so far."
    )


class TaskCancellingEvent(_TaskEvent):
    type: Literal["task.cancelling"]
    error: TaskError | None


class _TaskEnded(_TaskEvent):
    error: TaskError | None
    result: dict[str, Any] | None = Field(
        description='What the task made: `{"model": <the registered model>}`.'
    )


class TaskCompletedEvent(_TaskEnded):
    type: Literal["task.completed"]


class TaskFailedEvent(_TaskEnded):
    type: Literal["task.failed"]


class TaskCancelledEvent(_TaskEnded):
    type: Literal["task.cancelled"]


AnyEvent = Annotated[
    ResponseCreatedEvent
    | ResponseQueuedEvent
    | ResponseLoadingEvent
    | ResponseInProgressEvent
    | ResponseCancellingEvent
    | ResponseCompletedEvent
    | ResponseIncompleteEvent
    | ResponseFailedEvent
    | ResponseCancelledEvent
    | ResponseOutputItemAddedEvent
    | ResponseContentPartAddedEvent
    | ResponseOutputTextDeltaEvent
    | ResponseOutputTextDoneEvent
    | ResponseContentPartDoneEvent
    | ResponseOutputItemDoneEvent
    | ResponseReasoningTextDeltaEvent
    | ResponseReasoningTextDoneEvent
    | ResponseFunctionCallArgumentsDeltaEvent
    | ResponseFunctionCallArgumentsDoneEvent
    | ResponseCustomToolCallInputDeltaEvent
    | ResponseCustomToolCallInputDoneEvent
    | TaskCreatedEvent
    | TaskQueuedEvent
    | TaskLoadingEvent
    | TaskRunningEvent
    | TaskProgressEvent
    | TaskCancellingEvent
    | TaskCompletedEvent
    | TaskFailedEvent
    | TaskCancelledEvent,
    Field(discriminator="type"),
]


class Event(RootModel[AnyEvent]):
    """One event of a task's log, by its `type`. `sequence_number` starts at 0 and grows by
    exactly 1; the first event is `response.created` (`task.created`), the last exactly one
    terminal event (`response.completed`, `.incomplete`, `.failed`, `.cancelled`;
    `task.completed`, `.failed`, `.cancelled`). Lifecycle events carry the whole response as
    `response`; text arrives as `response.output_text.delta`."""


def event_types() -> dict[str, type[WireObject]]:
    """Every event type, with its model."""
    members: tuple[type[WireObject], ...] = get_args(get_args(AnyEvent)[0])
    return {get_args(member.model_fields["type"].annotation)[0]: member for member in members}


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
REASONING_DELTA = "response.reasoning_text.delta"
REASONING_DONE = "response.reasoning_text.done"
INPUT_DELTA = "response.custom_tool_call_input.delta"
INPUT_DONE = "response.custom_tool_call_input.done"
COMPLETED = "response.completed"
INCOMPLETE = "response.incomplete"
FAILED = "response.failed"
CANCELLED = "response.cancelled"


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


def reasoning_opened(item_id: str, output_index: int) -> list[EventData]:
    return [
        {
            "type": ITEM_ADDED,
            "output_index": output_index,
            "item": {
                "id": item_id,
                "type": "reasoning",
                "status": "in_progress",
                "summary": [],
                "content": [],
            },
        },
        {
            "type": PART_ADDED,
            "item_id": item_id,
            "output_index": output_index,
            "content_index": 0,
            "part": {"type": "reasoning_text", "text": ""},
        },
    ]


def reasoning_delta(item_id: str, output_index: int, delta: str) -> EventData:
    return {
        "type": REASONING_DELTA,
        "item_id": item_id,
        "output_index": output_index,
        "content_index": 0,
        "delta": delta,
    }


def reasoning_closed(
    item_id: str, output_index: int, text: str, status: str, encrypted: str | None = None
) -> list[EventData]:
    """The end of a reasoning item: its text, its part, then the item."""
    return [
        {
            "type": REASONING_DONE,
            "item_id": item_id,
            "output_index": output_index,
            "content_index": 0,
            "text": text,
        },
        {
            "type": PART_DONE,
            "item_id": item_id,
            "output_index": output_index,
            "content_index": 0,
            "part": {"type": "reasoning_text", "text": text},
        },
        {
            "type": ITEM_DONE,
            "output_index": output_index,
            "item": reasoning_item(item_id, text, status, encrypted),
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


def call_opened(
    item_id: str, call_id: str, output_index: int, name: str, custom: bool = False
) -> EventData:
    item = custom_tool_call_item if custom else function_call_item
    return {
        "type": ITEM_ADDED,
        "output_index": output_index,
        "item": item(item_id, call_id, name, "", "in_progress"),
    }


def call_arguments(item_id: str, output_index: int, delta: str, custom: bool = False) -> EventData:
    return {
        "type": INPUT_DELTA if custom else ARGUMENTS_DELTA,
        "item_id": item_id,
        "output_index": output_index,
        "delta": delta,
    }


def call_closed(
    item_id: str,
    call_id: str,
    output_index: int,
    name: str,
    arguments: str,
    status: str,
    custom: bool = False,
) -> list[EventData]:
    """The end of a call item: its arguments (a custom call's input), then the item. A call
    cut off (output limit, cancel) gets its `function_call_arguments.done` (`custom_tool_call_
    input.done`) too, with what was written so far: the Responses streams close every item's
    arguments before the item."""
    if custom:
        done = {"type": INPUT_DONE, "item_id": item_id, "output_index": output_index}
        done["input"] = arguments
        item = custom_tool_call_item(item_id, call_id, name, arguments, status)
    else:
        done = {"type": ARGUMENTS_DONE, "item_id": item_id, "output_index": output_index}
        done["arguments"] = arguments
        item = function_call_item(item_id, call_id, name, arguments, status)
    return [done, {"type": ITEM_DONE, "output_index": output_index, "item": item}]
