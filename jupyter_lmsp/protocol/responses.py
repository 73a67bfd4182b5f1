"""The Responses API on the wire (LMSP B5, B10): `POST /responses` bodies and its queries. Their
`input` items are in protocol.response_input, the response object in protocol.response_object.

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
    KEEP_ALIVE_DOC,
    Body,
    KeepAlive,
    Label,
    Metadata,
    Neutral,
    Penalty,
    Query,
    ReasoningBudget,
    ReasoningEffort,
    Seed,
    SequenceNumber,
    ServiceTier,
    Temperature,
    TokenLimit,
    TopP,
    by_json_type,
    refuse,
)
from .response_input import (
    INPUT_ITEM_TYPES,
    INPUT_TEXT_PART_TYPES,
    InputFunctionCall,
    InputFunctionCallOutput,
    InputItemParam,
    InputMessage,
    InputTextPart,
    engine_messages,
)
from .response_object import (
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
from .states import RestartPolicy
from .tools import (
    CHOICE_NEEDS_TOOLS,
    LOGPROBS_INCLUDE,
    AllowedTools,
    CustomChoice,
    FormatSpec,
    FunctionChoice,
    ResponsesToolChoice,
    ResponsesTools,
    Stop,
    TextFormat,
    ToolsSpec,
    TopLogprobs,
    flat_customs,
    flat_functions,
    responses_format,
    stop_list,
    top_logprobs_need,
)

# This module's request models, the input items (protocol.response_input), and the response
# object's models (protocol.response_object) that protocol.events, .output and .tasks import
# from here.
__all__ = [
    "INPUT_ITEM_TYPES",
    "INPUT_TEXT_PART_TYPES",
    "KNOWN_INCLUDES",
    "REASONING_INCLUDE",
    "RESPONSE_STATUSES",
    "BackgroundOptions",
    "CreateResponseRequest",
    "InputFunctionCall",
    "InputFunctionCallOutput",
    "InputItemParam",
    "InputItemsQuery",
    "InputMessage",
    "InputTextPart",
    "OutputItem",
    "OutputText",
    "Reasoning",
    "Response",
    "RetrieveResponseQuery",
    "StreamOptions",
    "TaskError",
    "TextConfig",
    "custom_tool_call_item",
    "engine_messages",
    "function_call_item",
    "output_message",
    "output_text_part",
    "reasoning_item",
]

RESPONSE_STATUSES = ("queued", "in_progress", "completed", "incomplete", "failed", "cancelled")


# What `include` may ask for. `reasoning.encrypted_content` (Codex always sends it) has nothing
# to include while no model here returns reasoning items: accepted, and correct as it is.
REASONING_INCLUDE = "reasoning.encrypted_content"
KNOWN_INCLUDES = (LOGPROBS_INCLUDE, REASONING_INCLUDE)


def _known_include(value: Any) -> Any:
    if isinstance(value, str) and value not in KNOWN_INCLUDES:
        raise refuse(
            "unsupported_parameter",
            f"'{{param}}' is {value!r}; only {LOGPROBS_INCLUDE!r} and {REASONING_INCLUDE!r} "
            "can be included here.",
        )
    return value


class ConversationRef(Body):
    """`conversation` as an object: `{"id": "conv_…"}`."""

    id: Annotated[str, Field(min_length=1)]


ConversationParam = Annotated[
    Annotated[Annotated[str, Field(min_length=1)], Tag("string")]
    | Annotated[ConversationRef, Tag("object")],
    by_json_type("a conversation id or an object with its 'id'"),
]


class StreamOptions(Body):
    include_obfuscation: Annotated[Any, Neutral(False)] = None


class TextConfig(Body):
    format: TextFormat | None = Field(
        None,
        description="`text` (the default), `json_object`, or `json_schema` (structured output, "
        "grammar-constrained).",
    )
    verbosity: Annotated[Any, Neutral("medium")] = None


class Reasoning(Body):
    """`reasoning`: the effort, as the model's chat template's switch (issue 37); a summary
    asked for is accepted (no summariser runs here: there is none to give)."""

    effort: ReasoningEffort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = Field(
        None, description="Accepted; no reasoning summary is produced (no reasoning items)."
    )
    generate_summary: Literal["auto", "concise", "detailed"] | None = Field(
        None, description="The older name of `summary`; accepted likewise."
    )


class BackgroundOptions(Body):
    completion_window: Annotated[Any, Neutral("soonest")] = None
    continuation_id: Label | None = None


# The `input` of the Responses requests: one user message, or a list of input items.
ResponsesInput = Annotated[
    Annotated[str, Tag("string")]
    | Annotated[list[InputItemParam], Field(min_length=1), Tag("array")],
    by_json_type("a string or a non-empty list of input items"),
]


def input_messages(value: str | list[Any]) -> list[dict[str, Any]]:
    """A Responses `input` as the engine's chat messages."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    return engine_messages(value)


class CreateResponseRequest(Body):
    """`POST /responses`. Unknown fields are refused (`unknown_parameter`), and so are fields
    the service cannot honour (`unsupported_parameter`)."""

    model: str | None = Field(None, description="A model id; the default model when absent.")
    input: Annotated[
        ResponsesInput,
        Field(
            description="A string (one user message) or a list of items: messages with text "
            "content, function calls, function call outputs and compaction items."
        ),
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
    # Labels and hints with no effect on the output: stored with the response and echoed
    # (`client_metadata` is stored only, as OpenAI does not echo it).
    user: Label | None = None
    safety_identifier: Annotated[str, Field(max_length=64)] | None = Field(
        None, description="Stored and echoed (no safety monitoring here)."
    )
    prompt_cache_key: Annotated[str, Field(max_length=64)] | None = Field(
        None,
        description="Stored and echoed; a routing hint: standalone workers claim the queued "
        "tasks of the keys they served recently first (their prompt caches hold them).",
    )
    client_metadata: dict[str, Any] | None = Field(
        None, description="The client's own labels (Codex sends them): stored, not echoed."
    )
    # Function tools (LMSP B11): the calls are grammar-constrained in the model's call format.
    tools: ResponsesTools | None = Field(
        None, description="Function tools, alone or in `namespace` tools."
    )
    tool_choice: ResponsesToolChoice | None = Field(
        None, description="Default `auto` with tools; `allowed_tools` offers only those."
    )
    parallel_tool_calls: bool | None = Field(
        None, description="Several calls in one answer (default true)."
    )
    max_tool_calls: Annotated[int, Field(ge=0)] | None = None
    text: TextConfig | None = None
    stop: Stop | None = Field(None, description="LMSP: stop sequences, as in Chat Completions.")
    include: (
        list[
            Annotated[
                Literal["message.output_text.logprobs", "reasoning.encrypted_content"],
                BeforeValidator(_known_include),
            ]
        ]
        | None
    ) = Field(
        None,
        description="`message.output_text.logprobs`; `reasoning.encrypted_content` is accepted "
        "(no reasoning items are produced, so there is nothing to include).",
    )
    top_logprobs: TopLogprobs | None = Field(
        None,
        description="With `include: ['message.output_text.logprobs']`: how many alternatives "
        "each token's entry lists (0-20).",
    )
    # Applied by the engine as logits processors (engine.penalties); echoed as used.
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    reasoning: Reasoning | None = None
    max_reasoning_tokens: ReasoningBudget | None = None
    keep_alive: KeepAlive | None = Field(None, description=KEEP_ALIVE_DOC)
    conversation: ConversationParam | None = Field(
        None,
        description='The conversation this response belongs to (its id, or `{"id"}`): its '
        "items come before `input`, and the input and output items join it when the response "
        "completes. Not with `previous_response_id`.",
    )
    truncation: Literal["auto", "disabled"] | None = Field(
        None,
        description="`auto`: when the prompt does not fit the context window, the oldest "
        "items are dropped (never the instructions or the last turn) and the response says "
        "so in `truncation_details`; `disabled` (default): a 400 `context_length_exceeded`.",
    )
    # Accepted only with neutral values, most significant first.
    prompt: Annotated[Any, Neutral()] = None
    context_management: Annotated[Any, Neutral([])] = None
    moderation: Annotated[Any, Neutral()] = None
    service_tier: ServiceTier = None
    background_options: BackgroundOptions | None = None
    prompt_cache_retention: Annotated[Any, Neutral("in_memory")] = None
    prompt_cache_options: Annotated[Any, Neutral({})] = None
    image: Annotated[Any, Neutral({})] = None
    access_programs: Annotated[Any, Neutral({})] = None

    @model_validator(mode="after")
    def _background_is_stored(self) -> CreateResponseRequest:
        if self.conversation is not None and self.previous_response_id is not None:
            raise refuse(
                "mutually_exclusive_parameters",
                "Mutually exclusive parameters: Ensure you are only providing one of: "
                "'previous_response_id' or 'conversation'.",
                param="conversation",
            )
        # A background response that is not stored could not be retrieved.
        if self.background and self.store is False:
            raise refuse(
                "invalid_value",
                "A background response must be stored ('store': true).",
                param="store",
            )
        if self.top_logprobs and not self.logprobs:
            # Asked for, they would be silently left out: the include says to compute them.
            raise refuse(
                "invalid_value",
                "'top_logprobs' needs 'include': ['message.output_text.logprobs'].",
                param="top_logprobs",
            )
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise refuse(
                "invalid_value",
                "'tool_choice' asks for a call, but there are no 'tools'.",
                param="tool_choice",
            )
        tools = self.tools or []
        functions = [f.name for f in flat_functions(tools)]
        customs = [c.name for c in flat_customs(tools)]
        names = functions + customs
        kinds = {name: "function" for name in functions} | {name: "custom" for name in customs}
        if len(set(names)) < len(names):
            # Namespaces are flattened for the model, which must tell every tool apart.
            dup = next(n for n in names if names.count(n) > 1)
            raise refuse(
                "invalid_value",
                f"Two tools are named {dup!r} (namespaces are flattened: names must differ).",
                param="tools",
            )
        choice = self.tool_choice
        if (
            isinstance(choice, FunctionChoice | CustomChoice)
            and choice.name in kinds
            and kinds[choice.name] != choice.type
        ):
            raise refuse(
                "invalid_value",
                f"'tool_choice' asks for a {choice.type} tool, but {choice.name!r} is a "
                f"{kinds[choice.name]} tool.",
                param="tool_choice.type",
            )
        if isinstance(choice, AllowedTools):
            for i, allowed in enumerate(choice.tools):
                if kinds.get(allowed.name) != allowed.type:
                    raise refuse(
                        "invalid_value",
                        f"'tool_choice.tools[{i}]' names no {allowed.type} tool of 'tools': "
                        f"{allowed.name!r}.",
                        param=f"tool_choice.tools[{i}].name",
                    )
        return self

    model_config = {
        "json_schema_extra": {
            "allOf": [
                {
                    "if": {
                        "required": ["background"],
                        "properties": {"background": {"const": True}},
                    },
                    "then": {"properties": {"store": {"enum": [True, None]}}},
                },
                top_logprobs_need(
                    {
                        "required": ["include"],
                        "properties": {
                            "include": {"type": "array", "contains": {"const": LOGPROBS_INCLUDE}}
                        },
                    }
                ),
                CHOICE_NEEDS_TOOLS,
                # `conversation` and `previous_response_id` are mutually exclusive.
                {
                    "if": {
                        "required": ["conversation"],
                        "properties": {"conversation": {"not": {"type": "null"}}},
                    },
                    "then": {"properties": {"previous_response_id": {"type": "null"}}},
                },
            ]
        }
    }

    @property
    def conversation_id(self) -> str | None:
        if isinstance(self.conversation, ConversationRef):
            return self.conversation.id
        return self.conversation

    @property
    def stored(self) -> bool:
        return self.store is not False

    @property
    def restart_policy(self) -> RestartPolicy:
        if self.on_restart is not None:
            return self.on_restart
        return RestartPolicy.RESUME if self.background else RestartPolicy.FAIL

    def messages(self) -> list[dict[str, Any]]:
        """`input` as the engine takes it: chat messages (role, text; assistant `tool_calls`,
        `tool` results)."""
        return input_messages(self.input)

    def raw_input(self) -> Any:
        """`input` as it was sent (stored, and echoed by `input_items`)."""
        if isinstance(self.input, str):
            return self.input
        return [m.model_dump(mode="json", exclude_unset=True, by_alias=True) for m in self.input]

    @property
    def logprobs(self) -> bool:
        return bool(self.include) and LOGPROBS_INCLUDE in (self.include or [])

    def stop_sequences(self) -> list[str]:
        return stop_list(self.stop)

    def format_spec(self) -> FormatSpec | None:
        return responses_format(self.text.format if self.text is not None else None)

    def tools_spec(self) -> ToolsSpec | None:
        """The function and custom tools (namespaces flattened) and how they may be called;
        None without tools. With `allowed_tools` only those are offered to the model, in its
        `mode`."""
        if not self.tools:
            return None
        functions = flat_functions(self.tools)
        customs = flat_customs(self.tools)
        choice = self.tool_choice
        if isinstance(choice, AllowedTools):
            allowed = {c.name for c in choice.tools}
            functions = [f for f in functions if f.name in allowed]
            customs = [c for c in customs if c.name in allowed]
            mode: str = choice.mode
        elif isinstance(choice, FunctionChoice | CustomChoice):
            mode = choice.name
        else:
            mode = choice or "auto"
        return ToolsSpec(
            tuple(functions),
            mode,
            self.parallel_tool_calls is not False,
            self.max_tool_calls,
            tuple(customs),
        )

    def namespaces(self) -> dict[str, str]:
        """Each namespaced tool's namespace, by the tool's name."""
        tools = self.tools or []
        found = {f.name: f.namespace for f in flat_functions(tools) if f.namespace is not None}
        found.update((c.name, c.namespace) for c in flat_customs(tools) if c.namespace is not None)
        return found


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
