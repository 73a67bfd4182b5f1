"""`POST /responses/compact` (Open Responses, OpenAI): a conversation compacted for the next
turns — every user message kept as it was, and everything else (the model's answers, its tool
calls and their outputs, earlier summaries) replaced by one `compaction` item whose sealed
content is a summary the model wrote. Sent back in a later request's `input`, the item stands
for the turns it replaced (`protocol.response_input.InputCompaction`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from .fields import Body, Neutral, WireObject, refuse
from .response_object import InputText, Usage
from .responses import ResponsesInput, input_messages


class CompactResponseRequest(Body):
    """The body of `POST /responses/compact`: a conversation given as `input`, as the turns
    before `previous_response_id`, or both (those turns first)."""

    model: str | None = Field(None, description="A model id; the default model when absent.")
    input: ResponsesInput | None = Field(
        None, description="The conversation's items (as for `POST /responses`)."
    )
    instructions: str | None = Field(
        None, description="The conversation's instructions (not compacted: send them again)."
    )
    previous_response_id: str | None = Field(
        None, description="Compact the conversation of this finished response (and `input`)."
    )
    prompt_cache_key: Annotated[str, Field(max_length=64)] | None = Field(
        None, description="Accepted; the prompt cache needs no key to route by."
    )
    service_tier: Annotated[
        Any,
        Neutral(
            "auto",
            "default",
            message="'{param}' can be 'auto' or 'default': every request is served by one queue.",
        ),
    ] = None
    prompt_cache_retention: Annotated[Any, Neutral("in_memory")] = None
    prompt_cache_options: Annotated[Any, Neutral({})] = None
    image: Annotated[Any, Neutral({})] = None

    @model_validator(mode="after")
    def _something_to_compact(self) -> CompactResponseRequest:
        if self.input is None and self.previous_response_id is None:
            raise refuse(
                "missing_required_parameter",
                "Give the conversation to compact: 'input', 'previous_response_id' or both.",
                param="input",
            )
        return self

    def messages(self) -> list[dict[str, Any]]:
        return [] if self.input is None else input_messages(self.input)


class CompactedUserMessage(WireObject):
    """A user message of the compacted conversation, kept as it was."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["user"] = "user"
    status: Literal["completed"] = "completed"
    content: list[InputText]


class CompactionItem(WireObject):
    """The turns a compaction replaced: their summary, sealed by the service (opaque to the
    client, opened only by this service, refused if altered)."""

    id: str
    type: Literal["compaction"] = "compaction"
    encrypted_content: str


CompactedItem = Annotated[CompactedUserMessage | CompactionItem, Field(discriminator="type")]


class CompactedResponse(WireObject):
    """The compacted conversation: its user messages, then one compaction item. `usage` is the
    compaction pass's (the summary's prompt and output)."""

    id: str
    object: Literal["response.compaction"] = "response.compaction"
    created_at: int
    output: list[CompactedItem]
    usage: Usage
