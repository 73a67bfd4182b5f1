"""The response object on the wire (LMSP B5, B10): the Open Responses spec's `ResponseResource`
with LMSP's fields beside, its output items, usage and error, and the input items a response
lists. `objects.response_object` builds it from stored rows; every field the spec requires is
declared here, typed as the spec types it (numbers where it says number, never null)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from .fields import Role, WireObject, optional_on_wire
from .states import RestartPolicy
from .tools import Logprob


class OutputText(WireObject):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Logprob] = Field(
        default_factory=list,
        description="With `include: ['message.output_text.logprobs']`: one entry per token.",
    )


class OutputMessage(WireObject):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class ReasoningText(WireObject):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(WireObject):
    """A reasoning model's thinking, kept apart from its answer (issue 37): the text of its
    thinking block in one `reasoning_text` part. `summary` is empty (no summariser runs here);
    `encrypted_content` holds the text sealed by the service when the request included
    `reasoning.encrypted_content`."""

    model_config = {"json_schema_extra": optional_on_wire("encrypted_content")}

    id: str
    type: Literal["reasoning"] = "reasoning"
    status: Literal["in_progress", "completed", "incomplete"]
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]
    encrypted_content: str | None = Field(None, exclude_if=lambda v: v is None)


def reasoning_item(
    item_id: str, text: str, status: str, encrypted_content: str | None = None
) -> dict[str, Any]:
    return ReasoningItem(
        id=item_id,
        status=status,
        content=[ReasoningText(text=text)],
        encrypted_content=encrypted_content,
    ).wire()


class FunctionCall(WireObject):
    """A call of one of the request's function tools: `arguments` is the JSON text of its
    arguments (an object). The client runs the function and sends a `function_call_output`
    with the same `call_id`."""

    model_config = {"json_schema_extra": optional_on_wire("namespace")}

    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]
    namespace: str | None = Field(
        None,
        description="The `namespace` tool the function came in (absent for a top-level function).",
        exclude_if=lambda v: v is None,
    )


class CustomToolCall(WireObject):
    """A call of one of the request's `custom` tools: `input` is the text the model wrote for
    it (a sentence of the tool's grammar, when it has one). The client runs the tool and sends
    a `custom_tool_call_output` with the same `call_id`."""

    model_config = {"json_schema_extra": optional_on_wire("namespace")}

    id: str
    type: Literal["custom_tool_call"] = "custom_tool_call"
    call_id: str
    name: str
    input: str
    status: Literal["in_progress", "completed", "incomplete"]
    namespace: str | None = Field(
        None,
        description="The `namespace` tool the custom tool came in (absent for a top-level one).",
        exclude_if=lambda v: v is None,
    )


OutputItem = Annotated[
    OutputMessage | ReasoningItem | FunctionCall | CustomToolCall, Field(discriminator="type")
]


# The log-probability entries of a text part are `tools.logprob_entry`'s, whose every entry
# has `Logprob`'s shape (tests/test_event_models.py): the part is validated without them and
# they are set in as built. Validating and dumping them again cost as much as the rest of a
# commit with `logprobs` on (issue 42: ~40% of the commit thread, 256 tokens x 6 entries at a
# message's end and again in the final response).


def output_text_part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    part = OutputText.model_validate({"text": text}).wire()
    part["logprobs"] = list(logprobs or [])
    return part


def output_message(
    item_id: str, text: str, status: str, logprobs: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    message = OutputMessage.model_validate(
        {"id": item_id, "status": status, "content": [{"text": text}]}
    ).wire()
    message["content"][0]["logprobs"] = list(logprobs or [])
    return message


def function_call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str
) -> dict[str, Any]:
    return FunctionCall(
        id=item_id,
        call_id=call_id,
        name=name,
        arguments=arguments,
        status=status,
    ).wire()


def custom_tool_call_item(
    item_id: str, call_id: str, name: str, text: str, status: str
) -> dict[str, Any]:
    return CustomToolCall(id=item_id, call_id=call_id, name=name, input=text, status=status).wire()


class InputTokensDetails(WireObject):
    cached_tokens: Annotated[int, Field(ge=0)]
    cache_write_tokens: Annotated[int, Field(ge=0)]


class OutputTokensDetails(WireObject):
    reasoning_tokens: Annotated[int, Field(ge=0)]
    accepted_draft_tokens: Annotated[int, Field(ge=0)] = Field(
        default=0,
        description="LMSP extension: of the output tokens, how many speculative decoding "
        "proposed and the model verified (ordinary output tokens, exactly those decoding "
        "without speculation gives; a resumed task counts those of its last attempt).",
    )


class Usage(WireObject):
    input_tokens: Annotated[int, Field(ge=0)]
    input_tokens_details: InputTokensDetails
    output_tokens: Annotated[int, Field(ge=0)]
    output_tokens_details: OutputTokensDetails
    total_tokens: Annotated[int, Field(ge=0)]


class TaskError(WireObject):
    """Why a task failed: a `code` (`server_restarted`, `worker_crashed`, …) and a message."""

    model_config = {"extra": "allow"}
    code: str
    message: str


class IncompleteDetails(WireObject):
    reason: str


class ConversationEcho(WireObject):
    """The conversation a response belongs to (`conversation` on `POST /responses`)."""

    id: str


class TruncationDetails(WireObject):
    """LMSP: what `truncation: "auto"` dropped to fit the prompt in the context window."""

    type: Literal["auto"] = "auto"
    dropped_messages: int = Field(
        description="How many of the oldest messages before this input were left out."
    )
    input_tokens_before: int = Field(description="The prompt's tokens before truncation.")


class FunctionToolEcho(WireObject):
    type: Literal["function"] = "function"
    name: str
    description: str | None
    parameters: dict[str, Any] | None
    strict: bool


class TextInputEcho(WireObject):
    type: Literal["text"] = "text"


class GrammarInputEcho(WireObject):
    type: Literal["grammar"] = "grammar"
    syntax: Literal["lark", "regex"]
    definition: str


class CustomToolEcho(WireObject):
    type: Literal["custom"] = "custom"
    name: str
    description: str | None
    format: Annotated[TextInputEcho | GrammarInputEcho, Field(discriminator="type")]


NamespacedToolEcho = Annotated[FunctionToolEcho | CustomToolEcho, Field(discriminator="type")]


class NamespaceToolEcho(WireObject):
    type: Literal["namespace"] = "namespace"
    name: str
    description: str
    tools: list[NamespacedToolEcho]


ToolEcho = Annotated[
    FunctionToolEcho | CustomToolEcho | NamespaceToolEcho, Field(discriminator="type")
]


class FunctionChoiceEcho(WireObject):
    type: Literal["function"] = "function"
    name: str


class CustomChoiceEcho(WireObject):
    type: Literal["custom"] = "custom"
    name: str


ChoiceEcho = Annotated[FunctionChoiceEcho | CustomChoiceEcho, Field(discriminator="type")]


class AllowedToolsEcho(WireObject):
    type: Literal["allowed_tools"] = "allowed_tools"
    mode: Literal["auto", "required"]
    tools: list[ChoiceEcho]


class ReasoningEcho(WireObject):
    """`reasoning` as asked for (no model here produces reasoning items)."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None
    summary: Literal["auto", "concise", "detailed"] | None


class FormatTextEcho(WireObject):
    type: Literal["text"] = "text"


class FormatJSONObjectEcho(WireObject):
    type: Literal["json_object"] = "json_object"


class FormatJSONSchemaEcho(WireObject):
    type: Literal["json_schema"] = "json_schema"
    name: str
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool
    description: str | None


class TextEcho(WireObject):
    """`text` as the request gave it (`format` `text` when it gave none)."""

    format: Annotated[
        FormatTextEcho | FormatJSONObjectEcho | FormatJSONSchemaEcho,
        Field(discriminator="type"),
    ]
    verbosity: Literal["low", "medium", "high"] = "medium"


class Response(WireObject):
    """A response, shaped as in the OpenAI Responses API, with LMSP fields `task_id`, `seed` and
    `on_restart`. `status` follows its task's state."""

    id: Annotated[str, Field(pattern="^resp_")]
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]
    background: bool
    error: TaskError | None
    incomplete_details: IncompleteDetails | None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: str | None
    temperature: float
    top_p: float
    presence_penalty: float
    frequency_penalty: float
    tool_choice: Annotated[
        Literal["auto", "none", "required"]
        | FunctionChoiceEcho
        | CustomChoiceEcho
        | AllowedToolsEcho,
        Field(union_mode="left_to_right"),
    ]
    tools: list[ToolEcho]
    max_tool_calls: int | None
    text: TextEcho
    top_logprobs: int
    truncation: Literal["auto", "disabled"]
    reasoning: ReasoningEcho | None
    usage: Usage | None
    metadata: dict[str, str]
    store: bool
    service_tier: Literal["default", "priority", "flex"]
    safety_identifier: str | None
    prompt_cache_key: str | None
    user: str | None
    completed_at: int | None
    task_id: Annotated[str, Field(pattern="^task_")]
    seed: int | None
    on_restart: RestartPolicy
    stop: list[str] | None = Field(description="LMSP: the stop sequences asked for.")
    conversation: ConversationEcho | None = None
    truncation_details: TruncationDetails | None = Field(
        None, description='LMSP: what `truncation: "auto"` dropped (null: nothing).'
    )


class ResponseDeleted(WireObject):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: Literal[True] = True


class InputText(WireObject):
    type: Literal["input_text"] = "input_text"
    text: str


class InputItem(WireObject):
    """One message of a response's `input` (assistant turns as output messages)."""

    id: str
    type: Literal["message"] = "message"
    role: Role
    status: str
    content: list[InputText | OutputText]


class InputFunctionCallItem(WireObject):
    """A function call given in a response's `input` (a call the model made earlier)."""

    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


class FunctionCallOutputItem(WireObject):
    """A function call's output given in a response's `input`."""

    id: str
    type: Literal["function_call_output"] = "function_call_output"
    call_id: str
    output: str
    status: Literal["in_progress", "completed", "incomplete"]


class InputCustomToolCallItem(WireObject):
    """A custom tool call given in a response's `input` (a call the model made earlier)."""

    id: str
    type: Literal["custom_tool_call"] = "custom_tool_call"
    call_id: str
    name: str
    input: str
    status: Literal["in_progress", "completed", "incomplete"]


class CustomToolCallOutputItem(WireObject):
    """A custom tool call's output given in a response's `input`."""

    id: str
    type: Literal["custom_tool_call_output"] = "custom_tool_call_output"
    call_id: str
    output: str
    status: Literal["in_progress", "completed", "incomplete"]


ListedInputItem = Annotated[
    InputItem
    | InputFunctionCallItem
    | FunctionCallOutputItem
    | InputCustomToolCallItem
    | CustomToolCallOutputItem,
    Field(discriminator="type"),
]


class InputItemList(WireObject):
    object: Literal["list"] = "list"
    data: list[ListedInputItem]
    first_id: str | None
    last_id: str | None
    has_more: bool
