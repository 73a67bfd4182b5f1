"""The Conversations API (OpenAI's shapes): request bodies, query parameters, the objects sent,
and an added item as a conversation stores and lists it (`conversation_item`).

A conversation's items are the items `POST /responses` takes as `input` (messages with text
content, function and custom tool calls and their outputs, reasoning and compaction items),
each stored with an `id` of its own and listed in the typed form the openai SDK's
`ConversationItem` reads (a message's content as typed parts, a `status`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, TypeAdapter

from .fields import Body, Metadata, Query, WireObject
from .ids import new_id
from .response_input import (
    InputCompaction,
    InputCustomToolCall,
    InputCustomToolCallOutput,
    InputFunctionCall,
    InputFunctionCallOutput,
    InputItemParam,
    InputMessage,
    InputReasoning,
    engine_messages,
)

# At most this many items in one request (OpenAI's limit on create and on adding items).
MAX_ITEMS_PER_REQUEST = 20

# What `include` may name on the items endpoints: what an item holds is listed as stored (an
# answer's log-probabilities are there when its response asked for them), so these two, which
# the Responses endpoint takes too, change nothing; anything else is refused by name.
ItemInclude = Literal["message.output_text.logprobs", "reasoning.encrypted_content"]

ConversationItems = Annotated[
    list[InputItemParam],
    Field(
        max_length=MAX_ITEMS_PER_REQUEST,
        description="Items as `POST /responses` takes them in `input` (at most 20 at a time).",
    ),
]


class CreateConversationRequest(Body):
    items: ConversationItems | None = None
    metadata: Metadata | None = None


class UpdateConversationRequest(Body):
    metadata: Annotated[Metadata | None, Field(description="Replaces the conversation's metadata.")]


class AddItemsRequest(Body):
    items: Annotated[ConversationItems, Field(min_length=1)]


def _split_commas(value: Any) -> Any:
    # `include=a,b` as well as `include=a&include=b`.
    if isinstance(value, str):
        return [part for part in value.split(",") if part]
    if isinstance(value, list):
        return [part for v in value for part in str(v).split(",") if part]
    return value


Includes = Annotated[list[ItemInclude], BeforeValidator(_split_commas)]


class IncludeQuery(Query):
    include: Includes | None = Field(
        None, description="Accepted for the openai SDK; items are listed as stored."
    )


class ListItemsQuery(IncludeQuery):
    after: str | None = Field(None, description="The last item id of the previous page.")
    limit: Annotated[int, Field(ge=1, le=100)] = Field(20, description="Page size (1-100).")
    order: Literal["asc", "desc"] = Field("desc", description="Order of the items.")


class ConversationObject(WireObject):
    id: str
    object: Literal["conversation"] = "conversation"
    created_at: int
    metadata: dict[str, str]


class ConversationDeleted(WireObject):
    id: str
    object: Literal["conversation.deleted"] = "conversation.deleted"
    deleted: Literal[True] = True


class ConversationItemList(WireObject):
    object: Literal["list"] = "list"
    data: list[dict[str, Any]] = Field(
        description="Items as stored: messages, function and custom tool calls and their "
        "outputs, reasoning and compaction items, each with its `id`."
    )
    first_id: str | None
    last_id: str | None
    has_more: bool


_ID_PREFIX = {
    "message": "msg",
    "function_call": "fc",
    "function_call_output": "fco",
    "custom_tool_call": "ctc",
    "custom_tool_call_output": "ctco",
    "reasoning": "rs",
    "compaction": "cmp",
}


def conversation_item(item: Any) -> dict[str, Any]:
    """An item added to a conversation, as it is stored and listed: a new `id` (an item may be
    added to several conversations, or twice), a `status`, and a message's content as typed
    parts (`output_text` with `annotations` for the assistant's, `input_text` otherwise)."""
    kind = getattr(item, "type", "message")
    wire = item.model_dump(mode="json", by_alias=True, exclude_none=True)
    wire["type"] = kind
    wire["id"] = new_id(_ID_PREFIX[kind])
    if isinstance(item, InputMessage):
        assistant = item.role == "assistant"
        parts: list[dict[str, Any]] = (
            [{"type": "input_text", "text": item.content}]
            if isinstance(item.content, str)
            else wire["content"]
        )
        for part in parts:
            if assistant and part["type"] in ("output_text", "text"):
                part["type"] = "output_text"
                part.setdefault("annotations", [])
            elif not assistant and part["type"] == "text":
                part["type"] = "input_text"
        if assistant and isinstance(item.content, str):
            parts = [{"type": "output_text", "text": item.content, "annotations": []}]
        wire["content"] = parts
    if isinstance(
        item,
        InputMessage
        | InputFunctionCall
        | InputFunctionCallOutput
        | InputCustomToolCall
        | InputReasoning,
    ):
        wire.setdefault("status", "completed")
    if isinstance(item, InputCustomToolCallOutput | InputCompaction):
        wire.pop("status", None)
    return wire


_ITEMS = TypeAdapter(list[InputItemParam])


def history_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A conversation's stored items as the chat messages a prompt is made of (as `input`'s
    items become them; compaction and sealed reasoning still to be opened by the service)."""
    # A custom tool's output listed from a response's input carries a `status` (as its
    # `input_items` shows it), which such an item sent as `input` does not take.
    readable = [
        {k: v for k, v in item.items() if k != "status"} if item.get("type") in _NO_STATUS else item
        for item in items
    ]
    return engine_messages(_ITEMS.validate_python(readable), param="conversation")


_NO_STATUS = ("custom_tool_call_output", "compaction")
