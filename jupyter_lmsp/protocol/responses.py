"""The Responses API on the wire (LMSP B5, B10): `POST /responses` bodies and the response object.

`CreateResponseRequest` accepts every field of the OpenAI Responses request (openai SDK 3.57's
`ResponseCreateParams`) that the service honours, or that is neutral as sent; a field it cannot
honour is refused by name (`unsupported_parameter`), an unknown one too (`unknown_parameter`).
Neutral fields are declared most significant first: with several refused at once, the error
names the first (`tools` before `tool_choice`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, Strict, Tag, model_validator

from .fields import (
    Body,
    Label,
    Metadata,
    Neutral,
    Query,
    Role,
    Seed,
    SequenceNumber,
    Temperature,
    TokenLimit,
    TopP,
    WireObject,
    by_json_type,
    refuse,
)
from .states import RestartPolicy

INPUT_TEXT_PART_TYPES = ("input_text", "output_text", "text")
RESPONSE_STATUSES = ("queued", "in_progress", "completed", "incomplete", "failed", "cancelled")


def _text_parts_only(value: Any) -> Any:
    if isinstance(value, dict) and value.get("type") not in INPUT_TEXT_PART_TYPES:
        raise refuse(
            "unsupported_input",
            "'{param}' must be a text part (type 'input_text', 'output_text' or 'text'); "
            "other kinds are not supported.",
        )
    return value


class InputTextPart(Body):
    """A text part of an input message (`input_text`; `output_text` in a replayed answer)."""

    type: Literal["input_text", "output_text", "text"]
    text: str
    # What the openai SDK's output_text parts carry when an answer is sent back as input.
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


def _messages_only(value: Any) -> Any:
    if value not in (None, "message"):
        raise refuse(
            "unsupported_input",
            "'{param}' is '" + str(value) + "'; only messages are supported.",
        )
    return value


class InputMessage(Body):
    """A message of `input`: the forms the openai SDK sends (EasyInputMessage, a typed message,
    an output message sent back)."""

    type: Annotated[Literal["message"], BeforeValidator(_messages_only)] = "message"
    role: Annotated[Role, Field(description="`developer` is treated as `system`.")]
    content: Annotated[
        Annotated[str, Tag("string")]
        | Annotated[
            list[Annotated[InputTextPart, BeforeValidator(_text_parts_only)]], Tag("array")
        ],
        by_json_type("a string or a list of text parts"),
    ]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: Literal["commentary", "final_answer"] | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(Body):
    include_obfuscation: Annotated[Any, Neutral(False)] = None


class TextConfig(Body):
    format: Annotated[Any, Neutral({"type": "text"})] = None
    verbosity: Annotated[Any, Neutral("medium")] = None


class Reasoning(Body):
    effort: Annotated[Any, Neutral("none")] = None
    summary: Annotated[Any, Neutral()] = None
    generate_summary: Annotated[Any, Neutral()] = None


class BackgroundOptions(Body):
    completion_window: Annotated[Any, Neutral("soonest")] = None
    continuation_id: Label | None = None


class CreateResponseRequest(Body):
    """`POST /responses`. Unknown fields are refused (`unknown_parameter`), and so are fields
    the service cannot honour (`unsupported_parameter`)."""

    model: str | None = Field(None, description="A model id; the default model when absent.")
    input: Annotated[
        Annotated[str, Tag("string")]
        | Annotated[list[InputMessage], Field(min_length=1), Tag("array")],
        by_json_type("a string or a non-empty list of messages"),
        Field(description="A string (one user message) or a list of messages with text content."),
    ]
    instructions: str | None = Field(None, description="A system message before `input`.")
    max_output_tokens: TokenLimit | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    seed: Seed | None = None
    stream: bool | None = Field(
        None, description="Answer `200 text/event-stream` with the task's events (from 0)."
    )
    background: bool | None = Field(
        None,
        description="Run as a background task (requires `store`): `202` with the queued "
        "response, or with `stream` its events, resumable after the client leaves.",
    )
    store: bool | None = Field(
        None, description="Defaults to true; must be true with `background`."
    )
    previous_response_id: str | None = Field(
        None, description="Continue the conversation of a finished response."
    )
    metadata: Metadata | None = None
    # Lax: an enum's JSON value is its string.
    on_restart: Annotated[RestartPolicy, Strict(False)] | None = Field(
        None,
        description="LMSP: what happens to the task if the service restarts "
        "(default `resume` for background, `fail` otherwise).",
    )
    stream_options: StreamOptions | None = None
    # Labels and hints with no effect on the output.
    user: Label | None = None
    safety_identifier: Label | None = None
    prompt_cache_key: Label | None = None
    # With no tools, any bound on tool calls holds.
    max_tool_calls: Annotated[int, Field(ge=0)] | None = None
    parallel_tool_calls: bool | None = None
    # Accepted only with neutral values, most significant first.
    tools: Annotated[Any, Neutral([])] = None
    tool_choice: Annotated[Any, Neutral("none", "auto")] = None
    text: TextConfig | None = None
    include: Annotated[Any, Neutral([])] = None
    top_logprobs: Annotated[Any, Neutral(0)] = None
    reasoning: Reasoning | None = None
    conversation: Annotated[Any, Neutral()] = None
    prompt: Annotated[Any, Neutral()] = None
    truncation: Annotated[Any, Neutral("disabled")] = None
    context_management: Annotated[Any, Neutral([])] = None
    moderation: Annotated[Any, Neutral()] = None
    service_tier: Annotated[Any, Neutral("auto", "default")] = None
    background_options: BackgroundOptions | None = None
    prompt_cache_retention: Annotated[Any, Neutral("in_memory")] = None
    prompt_cache_options: Annotated[Any, Neutral({})] = None
    image: Annotated[Any, Neutral({})] = None
    access_programs: Annotated[Any, Neutral({})] = None

    @model_validator(mode="after")
    def _background_is_stored(self) -> CreateResponseRequest:
        # A background response that is not stored could not be retrieved.
        if self.background and self.store is False:
            raise refuse(
                "invalid_value",
                "A background response must be stored ('store': true).",
                param="store",
            )
        return self

    model_config = {
        "json_schema_extra": {
            "if": {"required": ["background"], "properties": {"background": {"const": True}}},
            "then": {"properties": {"store": {"enum": [True, None]}}},
        }
    }

    @property
    def stored(self) -> bool:
        return self.store is not False

    @property
    def restart_policy(self) -> RestartPolicy:
        if self.on_restart is not None:
            return self.on_restart
        return RestartPolicy.RESUME if self.background else RestartPolicy.FAIL

    def messages(self) -> list[dict[str, str]]:
        """`input` as the engine takes it: role (system, user, assistant) and text."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        return [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for m in self.input
        ]

    def raw_input(self) -> Any:
        """`input` as it was sent (stored, and echoed by `input_items`)."""
        if isinstance(self.input, str):
            return self.input
        return [m.model_dump(mode="json", exclude_unset=True) for m in self.input]


# ---------------------------------------------------------------------------------------------
# the response object


class OutputText(WireObject):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(WireObject):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


def output_text_part(text: str) -> dict[str, Any]:
    return OutputText(text=text).wire()


def output_message(item_id: str, text: str, status: str) -> dict[str, Any]:
    return OutputMessage(id=item_id, status=status, content=[OutputText(text=text)]).wire()


class InputTokensDetails(WireObject):
    cached_tokens: Annotated[int, Field(ge=0)]
    cache_write_tokens: Annotated[int, Field(ge=0)]


class OutputTokensDetails(WireObject):
    reasoning_tokens: Annotated[int, Field(ge=0)]


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
    output: list[OutputMessage]
    parallel_tool_calls: bool
    previous_response_id: str | None
    temperature: float | None
    top_p: float | None
    tool_choice: str
    tools: Annotated[list[Any], Field(max_length=0)]
    text: dict[str, Any]
    truncation: str
    usage: Usage | None
    metadata: dict[str, str]
    store: bool
    completed_at: int | None
    task_id: Annotated[str, Field(pattern="^task_")]
    seed: int | None
    on_restart: RestartPolicy


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


class InputItemList(WireObject):
    object: Literal["list"] = "list"
    data: list[InputItem]
    first_id: str | None
    last_id: str | None
    has_more: bool


# ---------------------------------------------------------------------------------------------
# query parameters


class RetrieveResponseQuery(Query):
    stream: bool = Field(
        False,
        description="Stream the stored events, then the live ones, until the terminal event.",
    )
    starting_after: SequenceNumber = Field(
        -1, description="With `stream`: only the events after this sequence number."
    )


class InputItemsQuery(Query):
    after: str | None = Field(None, description="The last item id of the previous page.")
    limit: Annotated[int, Field(ge=1, le=100)] = Field(20, description="Page size.")
    order: Literal["asc", "desc"] = Field("desc", description="Order of the items.")
