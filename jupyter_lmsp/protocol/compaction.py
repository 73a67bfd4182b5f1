"""`POST /responses/compact` (Open Responses, OpenAI): a conversation compacted for the next
turns — every user message kept as it was, and everything else (the model's answers, its tool
calls and their outputs, earlier summaries) replaced by one `compaction` item whose sealed
content is a summary the model wrote. Sent back in a later request's `input`, the item stands
for the turns it replaced (`protocol.response_input.InputCompaction`). And `POST
/responses/input_tokens` (OpenAI): what such a conversation, with its instructions and tools,
comes to in the model's tokens."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from .fields import Body, Neutral, WireObject, refuse
from .response_object import InputText, Usage
from .responses import (
    CreateResponseRequest,
    Reasoning,
    ResponsesInput,
    ServiceTier,
    TextConfig,
    input_messages,
)
from .tools import ResponsesToolChoice, ResponsesTools


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
        None,
        description="Accepted; a routing hint for the compaction pass, as on `POST /responses`.",
    )
    service_tier: ServiceTier = None
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


class InputTokensRequest(Body):
    """The body of `POST /responses/input_tokens`: what a `POST /responses` would give the
    model (its input, the turns before `previous_response_id`, its instructions and tools),
    counted without running it."""

    model: str | None = Field(None, description="A model id; the default model when absent.")
    input: ResponsesInput | None = Field(None, description="As for `POST /responses`.")
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: ResponsesTools | None = Field(
        None, description="Counted as the model's template renders them."
    )
    tool_choice: ResponsesToolChoice | None = Field(
        None, description="`allowed_tools` counts only the tools it offers."
    )
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = Field(None, description="Accepted: a format adds no prompt tokens.")
    reasoning: Reasoning | None = None
    truncation: Annotated[Any, Neutral("disabled")] = None
    conversation: Annotated[Any, Neutral()] = None
    personality: Annotated[Any, Neutral()] = None

    @model_validator(mode="after")
    def _something_to_count(self) -> InputTokensRequest:
        if self.input is None and self.previous_response_id is None and not self.instructions:
            raise refuse(
                "missing_required_parameter",
                "Give the prompt to count: 'input', 'previous_response_id' or 'instructions'.",
                param="input",
            )
        return self

    def as_create_request(self) -> CreateResponseRequest:
        """The fields as the create request they describe (its prompt and tools), unvalidated
        beyond this body's own validation."""
        fields = {name: getattr(self, name) for name in self.model_fields_set}
        return CreateResponseRequest.model_construct(**{**fields, "input": self.input or []})

    def messages(self) -> list[dict[str, Any]]:
        return [] if self.input is None else input_messages(self.input)


class InputTokenCount(WireObject):
    object: Literal["response.input_tokens"] = "response.input_tokens"
    input_tokens: Annotated[int, Field(ge=0)]
