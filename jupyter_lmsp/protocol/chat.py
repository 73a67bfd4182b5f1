"""Chat Completions on the wire (LMSP B5, for clients of the older OpenAI API): the
`POST /chat/completions` body, and the `chat.completion` and `chat.completion.chunk` objects.

As with the Responses API, a field the service cannot honour is refused by name with a 400
rather than ignored; neutral values that SDKs and frameworks send by default (`n: 1`,
`tools: []`, ...) are accepted. Error `param`s use the Chat Completions
names (`messages[2].content`, `max_tokens`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, Tag, model_validator

from .fields import (
    KEEP_ALIVE_DOC,
    Body,
    KeepAlive,
    Label,
    Metadata,
    Neutral,
    Penalty,
    ReasoningBudget,
    ReasoningEffort,
    Seed,
    ServiceTier,
    Temperature,
    TokenLimit,
    TopP,
    WireObject,
    by_json_type,
    optional_on_wire,
    refuse,
)
from .tools import (
    CHOICE_NEEDS_TOOLS,
    ChatFunctionChoice,
    ChatResponseFormat,
    ChatToolChoice,
    ChatTools,
    FormatSpec,
    Logprob,
    Stop,
    ToolsSpec,
    TopLogprobs,
    chat_format,
    stop_list,
    top_logprobs_need,
)


def _no_function_role(value: Any) -> Any:
    if value == "function":
        raise refuse(
            "unsupported_input",
            "'{param}' is 'function' (the deprecated function calling); use 'tools' and "
            "'tool' messages.",
        )
    return value


def _text_parts_only(value: Any) -> Any:
    if isinstance(value, dict) and value.get("type") != "text":
        raise refuse(
            "unsupported_input",
            "'{param}' must be a text part (type 'text'); other kinds are not supported.",
        )
    return value


class CacheControl(Body):
    """Anthropic-style prompt-caching mark, as LiteLLM adds it (Jupyter AI's Jupyternaut marks
    its system message so by default). Accepted and without effect: this service keeps the
    prefixes of recent prompts by itself (docs/protocol.md, Chat Completions)."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


CACHE_CONTROL = Field(
    None,
    description='Anthropic-style prompt-caching mark (`{"type": "ephemeral"}`), as LiteLLM '
    "sends it: accepted, no effect (this service caches prompt prefixes by itself).",
)


class ChatTextPart(Body):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = CACHE_CONTROL


class ToolCallFunction(Body):
    name: str
    arguments: str = Field(description="The JSON text of the call's arguments.")


def _function_calls_only(value: Any) -> Any:
    if isinstance(value, dict) and value.get("type", "function") != "function":
        raise refuse(
            "unsupported_input",
            "'{param}' is a '" + str(value.get("type")) + "' tool call; only function calls "
            "are supported.",
        )
    return value


class ToolCallParam(Body):
    id: Annotated[str, Field(min_length=1)]
    type: Literal["function"]
    function: ToolCallFunction


class ChatMessage(Body):
    """A message of `messages`. An assistant message may carry `tool_calls` (then its
    `content` may be absent); a `tool` message answers one call (`tool_call_id`)."""

    role: Annotated[
        Literal["system", "developer", "user", "assistant", "tool"],
        BeforeValidator(_no_function_role),
        Field(description="`developer` is treated as `system`."),
    ]
    content: (
        Annotated[
            Annotated[str, Tag("string")]
            | Annotated[
                list[Annotated[ChatTextPart, BeforeValidator(_text_parts_only)]], Tag("array")
            ],
            by_json_type("a string or a list of text parts"),
        ]
        | None
    ) = None
    name: str | None = None
    tool_calls: list[Annotated[ToolCallParam, BeforeValidator(_function_calls_only)]] | None = (
        Field(None, description="Assistant messages: the calls the model made.")
    )
    tool_call_id: str | None = Field(None, description="Tool messages: the call answered.")
    cache_control: CacheControl | None = CACHE_CONTROL
    # What the openai SDK's typed assistant messages may carry, accepted only when empty.
    function_call: Annotated[Any, Neutral([])] = None
    refusal: Annotated[Any, Neutral([])] = None
    audio: Annotated[Any, Neutral([])] = None
    # What an assistant message of a completion has (a client sending it back as it is).
    annotations: Annotated[Any, Neutral([])] = None

    model_config = {
        "json_schema_extra": {
            "allOf": [
                {
                    "if": {
                        "required": ["tool_calls"],
                        "properties": {"tool_calls": {"type": "array", "minItems": 1}},
                    },
                    "then": {"properties": {"role": {"const": "assistant"}}},
                },
                {
                    "if": {"properties": {"role": {"const": "tool"}}},
                    "then": {
                        "required": ["tool_call_id"],
                        "properties": {"tool_call_id": {"type": "string", "minLength": 1}},
                    },
                },
                {
                    # `content` may be absent only from an assistant message with calls.
                    "if": {
                        "required": ["role", "tool_calls"],
                        "properties": {
                            "role": {"const": "assistant"},
                            "tool_calls": {"type": "array", "minItems": 1},
                        },
                    },
                    "else": {
                        "required": ["content"],
                        "properties": {"content": {"not": {"type": "null"}}},
                    },
                },
            ]
        }
    }

    @model_validator(mode="after")
    def _shape(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise refuse(
                "invalid_value", "Only assistant messages have 'tool_calls'.", field="tool_calls"
            )
        if self.role == "tool" and not self.tool_call_id:
            raise refuse(
                "invalid_value",
                "A tool message needs the 'tool_call_id' of the call it answers.",
                field="tool_call_id",
            )
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise refuse("invalid_value", "This message needs 'content'.", field="content")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def engine(self) -> dict[str, Any]:
        """As the engine takes it (`developer` as `system`)."""
        role = "system" if self.role == "developer" else self.role
        out: dict[str, Any] = {"role": role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [
                {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                for c in self.tool_calls
            ]
        if self.role == "tool":
            out["tool_call_id"] = self.tool_call_id
        return out


class ChatStreamOptions(Body):
    include_usage: bool | None = None
    include_obfuscation: Annotated[Any, Neutral(False)] = None


class CreateChatCompletionRequest(Body):
    """A chat completion runs as a response task (restart policy `fail`). `max_tokens` and
    `max_completion_tokens` must agree when both are given."""

    model: str | None = Field(None, description="A model id; the default model when absent.")
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: TokenLimit | None = Field(None, description="Same as `max_completion_tokens`.")
    max_completion_tokens: TokenLimit | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    seed: Seed | None = None
    stream: bool | None = None
    stream_options: ChatStreamOptions | None = Field(None, description="Only with `stream`.")
    metadata: Metadata | None = None
    # Labels and hints with no effect on the output: checked to be strings, then unused.
    user: Label | None = None
    safety_identifier: Label | None = None
    prompt_cache_key: str | None = Field(
        None,
        description="A routing hint: standalone workers claim the queued tasks of the keys they "
        "served recently first (the first 64 characters count).",
    )
    # Function tools and structured output (LMSP B11), grammar-constrained.
    tools: ChatTools | None = Field(None, description="Function tools only.")
    tool_choice: ChatToolChoice | None = Field(None, description="Default `auto` with tools.")
    parallel_tool_calls: bool | None = Field(
        None, description="Several calls in one answer (default true)."
    )
    response_format: ChatResponseFormat | None = None
    n: Annotated[int, Field(ge=1)] | None = Field(
        None,
        description="Choices to generate (at most `LMSPExtension.max_choices`, default 4); "
        "each has its own `index` and `finish_reason`.",
    )
    stop: Stop | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = Field(None, description="Needs `logprobs: true`.")
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    reasoning_effort: ReasoningEffort | None = None
    max_reasoning_tokens: ReasoningBudget | None = None
    keep_alive: KeepAlive | None = Field(None, description=KEEP_ALIVE_DOC)
    # Accepted only with neutral values, most significant first.
    functions: Annotated[Any, Neutral([])] = None
    function_call: Annotated[Any, Neutral("none", "auto")] = None
    logit_bias: Annotated[Any, Neutral({})] = None
    store: Annotated[
        Any,
        Neutral(
            False,
            message="Stored chat completions ('store': true) are not supported; every chat "
            "completion is kept as an LMSP response, readable at /responses/{response_id}.",
        ),
    ] = None
    modalities: Annotated[Any, Neutral(["text"])] = None
    audio: Annotated[Any, Neutral()] = None
    prediction: Annotated[Any, Neutral()] = None
    web_search_options: Annotated[Any, Neutral()] = None
    verbosity: Annotated[Any, Neutral()] = None
    service_tier: ServiceTier = None
    prompt_cache_retention: Annotated[Any, Neutral("in_memory")] = None
    prompt_cache_options: Annotated[Any, Neutral({})] = None
    moderation: Annotated[Any, Neutral()] = None

    @model_validator(mode="after")
    def _consistent(self) -> CreateChatCompletionRequest:
        if (
            self.max_tokens is not None
            and self.max_completion_tokens is not None
            and self.max_tokens != self.max_completion_tokens
        ):
            raise refuse(
                "invalid_value",
                "'max_tokens' and 'max_completion_tokens' disagree; give only one of them.",
                param="max_tokens",
            )
        if self.stream_options is not None and not self.stream:
            raise refuse(
                "invalid_value",
                "'stream_options' is only allowed with 'stream': true.",
                param="stream_options",
            )
        if self.top_logprobs and not self.logprobs:
            raise refuse(
                "invalid_value", "'top_logprobs' needs 'logprobs': true.", param="top_logprobs"
            )
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise refuse(
                "invalid_value",
                "'tool_choice' asks for a call, but there are no 'tools'.",
                param="tool_choice",
            )
        return self

    model_config = {
        "json_schema_extra": {
            "allOf": [
                {
                    # `stream_options` (not null) only with `stream: true`.
                    "if": {
                        "required": ["stream_options"],
                        "properties": {"stream_options": {"type": "object"}},
                    },
                    "then": {"required": ["stream"], "properties": {"stream": {"const": True}}},
                },
                top_logprobs_need(
                    {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}
                ),
                CHOICE_NEEDS_TOOLS,
            ]
        }
    }

    @property
    def token_limit(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def engine_messages(self) -> list[dict[str, Any]]:
        """As the engine takes them: role in system/user/assistant/tool, content a string,
        assistant `tool_calls` and `tool_call_id`s."""
        return [m.engine() for m in self.messages]

    def stop_sequences(self) -> list[str]:
        return stop_list(self.stop)

    def format_spec(self) -> FormatSpec | None:
        return chat_format(self.response_format)

    def tools_spec(self) -> ToolsSpec | None:
        if not self.tools:
            return None
        choice = self.tool_choice
        return ToolsSpec(
            tuple(tool.function.spec() for tool in self.tools),
            choice.function.name if isinstance(choice, ChatFunctionChoice) else (choice or "auto"),
            self.parallel_tool_calls is not False,
            None,
        )


# ---------------------------------------------------------------------------------------------
# objects


class PromptTokensDetails(WireObject):
    cached_tokens: int
    audio_tokens: int


class CompletionTokensDetails(WireObject):
    reasoning_tokens: int
    audio_tokens: int
    accepted_prediction_tokens: int
    rejected_prediction_tokens: int
    accepted_draft_tokens: int = Field(
        default=0,
        description="LMSP extension: completion tokens speculative decoding proposed and the "
        "model verified (as the Responses usage's output_tokens_details).",
    )


class ChatUsage(WireObject):
    prompt_tokens: Annotated[int, Field(ge=0)]
    completion_tokens: Annotated[int, Field(ge=0)]
    total_tokens: Annotated[int, Field(ge=0)]
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails


class ToolCallFunctionOut(WireObject):
    name: str
    arguments: str


class ToolCall(WireObject):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunctionOut


class AssistantMessage(WireObject):
    model_config = {"json_schema_extra": optional_on_wire("reasoning_content")}

    role: Literal["assistant"] = "assistant"
    content: str | None = Field(description="Null when the answer is only tool calls.")
    reasoning_content: str | None = Field(
        None,
        description="A thinking model's thinking, apart from its answer (absent otherwise).",
        exclude_if=lambda v: v is None,
    )
    refusal: None = None
    annotations: list[Any] = Field(default_factory=list)
    tool_calls: list[ToolCall] | None = None


class ChoiceLogprobs(WireObject):
    content: list[Logprob] | None
    refusal: None = None


FinishReason = Literal["stop", "length", "tool_calls"]


class Choice(WireObject):
    index: Annotated[int, Field(ge=0)]
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = Field(description="With `logprobs: true`.")
    finish_reason: FinishReason


class _ChatEnvelope(WireObject):
    id: Annotated[str, Field(pattern="^chatcmpl-")]
    created: int
    model: str
    system_fingerprint: None = None
    service_tier: None = None
    # LMSP fields: where the work that produced it can be read.
    response_id: str = Field(description="LMSP: the response that holds this completion.")
    task_id: str = Field(description="LMSP: the task that generated it.")
    seed: int | None


class ChatCompletion(_ChatEnvelope):
    object: Literal["chat.completion"] = "chat.completion"
    choices: Annotated[list[Choice], Field(min_length=1)]
    usage: ChatUsage


class ChunkToolCallFunction(WireObject):
    name: str | None = None
    arguments: str | None = None

    model_config = {"json_schema_extra": optional_on_wire("name", "arguments")}


class ChunkToolCall(WireObject):
    """A piece of a tool call: its first chunk has `id`, `type` and the function's `name`,
    the next ones more of its `arguments`."""

    index: Annotated[int, Field(ge=0)]
    id: str | None = None
    type: Literal["function"] | None = None
    function: ChunkToolCallFunction

    model_config = {"json_schema_extra": optional_on_wire("id", "type")}


class ChunkDelta(WireObject):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ChunkToolCall] | None = None

    model_config = {
        "json_schema_extra": optional_on_wire("role", "content", "reasoning_content", "tool_calls")
    }


class ChunkChoice(WireObject):
    index: Annotated[int, Field(ge=0)] = 0
    delta: ChunkDelta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReason | None


class ChatCompletionChunk(_ChatEnvelope):
    """One `data:` line of a chat stream (which ends with `data: [DONE]`). With
    `include_usage`, every chunk has `usage`, null but in the last (whose `choices` is empty);
    without it, none has."""

    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChunkChoice]
    usage: ChatUsage | None = None

    model_config = {"json_schema_extra": optional_on_wire("usage")}


def completion_id(response_id: str) -> str:
    """The chat completion's id, derived from its response's (`resp_X` → `chatcmpl-X`)."""
    return "chatcmpl-" + response_id.split("_", 1)[1]


def chat_usage(usage: dict[str, Any] | None) -> ChatUsage:
    """A Responses `usage` object in the Chat Completions shape."""
    usage = usage or {}
    prompt = usage.get("input_tokens", 0)
    completion = usage.get("output_tokens", 0)
    cached = (usage.get("input_tokens_details") or {}).get("cached_tokens", 0)
    details = usage.get("output_tokens_details") or {}
    drafted = details.get("accepted_draft_tokens", 0)
    return ChatUsage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached, audio_tokens=0),
        completion_tokens_details=CompletionTokensDetails(
            reasoning_tokens=details.get("reasoning_tokens", 0),
            audio_tokens=0,
            accepted_prediction_tokens=0,
            rejected_prediction_tokens=0,
            accepted_draft_tokens=drafted,
        ),
    )


def _envelope(response: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": completion_id(response["id"]),
        "created": response["created_at"],
        "model": response["model"],
        "response_id": response["id"],
        "task_id": response["task_id"],
        "seed": response.get("seed"),
    }


# ---------------------------------------------------------------------------------------------
# from a response's events to chat choices


@dataclass
class ChoiceState:
    """One choice of a chat completion, as its task's events built it."""

    content: str = ""
    # A thinking model's thinking (None: it had no thinking block).
    reasoning: str | None = None
    tool_calls: list[dict[str, str]] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    items: int = 0
    cut: bool = False  # an item of it ended incomplete (the token limit)

    def finish_reason(self, response_incomplete: bool) -> FinishReason:
        if self.cut or (self.items == 0 and response_incomplete):
            return "length"
        return "tool_calls" if self.tool_calls else "stop"


@dataclass
class ChunkPiece:
    """What one event adds to one choice of a chat stream."""

    choice: int
    delta: ChunkDelta
    logprobs: list[dict[str, Any]] | None = None


class ChatFold:
    """Folds a response task's events into chat choices (`choices`), and says what each
    event adds to a stream (`feed`). Item events of a job with n > 1 name their `choice`."""

    def __init__(self, n: int = 1, logprobs: bool = False) -> None:
        self.choices = [ChoiceState() for _ in range(max(1, n))]
        self.logprobs = logprobs
        self._choice_of: dict[str, int] = {}
        self._call_of: dict[str, int] = {}

    def _state(self, choice: int) -> ChoiceState:
        while len(self.choices) <= choice:
            self.choices.append(ChoiceState())
        return self.choices[choice]

    def feed(self, event: dict[str, Any]) -> list[ChunkPiece]:
        kind = event.get("type")
        if kind == "response.output_item.added":
            item = event.get("item") or {}
            choice = int(event.get("choice", 0))
            self._choice_of[item.get("id", "")] = choice
            state = self._state(choice)
            state.items += 1
            if item.get("type") == "function_call":
                index = len(state.tool_calls)
                self._call_of[item["id"]] = index
                state.tool_calls.append(
                    {"id": item["call_id"], "name": item["name"], "arguments": ""}
                )
                call = ChunkToolCall(
                    index=index,
                    id=item["call_id"],
                    type="function",
                    function=ChunkToolCallFunction(name=item["name"], arguments=""),
                )
                return [ChunkPiece(choice, ChunkDelta(tool_calls=[call]))]
            return []
        if kind == "response.output_text.delta":
            choice = self._choice_of.get(event.get("item_id", ""), int(event.get("choice", 0)))
            state = self._state(choice)
            state.content += event.get("delta", "")
            logprobs = list(event.get("logprobs") or [])
            state.logprobs.extend(logprobs)
            if not event.get("delta") and not logprobs:
                return []
            return [
                ChunkPiece(
                    choice,
                    ChunkDelta(content=event.get("delta", "")),
                    logprobs if self.logprobs else None,
                )
            ]
        if kind == "response.reasoning_text.delta":
            choice = self._choice_of.get(event.get("item_id", ""), int(event.get("choice", 0)))
            state = self._state(choice)
            state.reasoning = (state.reasoning or "") + event.get("delta", "")
            return [ChunkPiece(choice, ChunkDelta(reasoning_content=event.get("delta", "")))]
        if kind == "response.function_call_arguments.delta":
            item_id = event.get("item_id", "")
            choice = self._choice_of.get(item_id, 0)
            index = self._call_of.get(item_id, 0)
            state = self._state(choice)
            state.tool_calls[index]["arguments"] += event.get("delta", "")
            call = ChunkToolCall(
                index=index, function=ChunkToolCallFunction(arguments=event.get("delta", ""))
            )
            return [ChunkPiece(choice, ChunkDelta(tool_calls=[call]))]
        if kind == "response.output_item.done":
            item = event.get("item") or {}
            choice = self._choice_of.get(item.get("id", ""), int(event.get("choice", 0)))
            state = self._state(choice)
            if item.get("status") == "incomplete":
                state.cut = True
            if item.get("type") == "function_call" and item.get("id") in self._call_of:
                # The authoritative arguments (the deltas add up to them).
                state.tool_calls[self._call_of[item["id"]]]["arguments"] = item["arguments"]
            return []
        if kind == "response.queued":
            # A retried attempt starts over (chat completions run with `fail`, but a paused
            # generation never does this; kept for completeness).
            n = len(self.choices)
            self.choices = [ChoiceState() for _ in range(n)]
        return []

    def finish_reasons(self, response: dict[str, Any]) -> list[FinishReason]:
        incomplete = (response.get("incomplete_details") or {}).get("reason") is not None
        return [state.finish_reason(incomplete) for state in self.choices]

    def choice_logprobs(self, logprobs: list[dict[str, Any]] | None) -> ChoiceLogprobs | None:
        if not self.logprobs:
            return None
        return ChoiceLogprobs.model_validate({"content": logprobs or []})


def completion_object(response: dict[str, Any], fold: ChatFold) -> dict[str, Any]:
    """The `chat.completion` for a finished (completed or incomplete) response, whose events
    `fold` has read."""
    reasons = fold.finish_reasons(response)
    choices = []
    for index, state in enumerate(fold.choices):
        calls = [
            ToolCall(
                id=c["id"], function=ToolCallFunctionOut(name=c["name"], arguments=c["arguments"])
            )
            for c in state.tool_calls
        ]
        choices.append(
            Choice(
                index=index,
                message=AssistantMessage(
                    content=None if calls and not state.content else state.content,
                    reasoning_content=state.reasoning,
                    tool_calls=calls or None,
                ),
                logprobs=fold.choice_logprobs(state.logprobs),
                finish_reason=reasons[index],
            )
        )
    return ChatCompletion(
        **_envelope(response), choices=choices, usage=chat_usage(response.get("usage"))
    ).wire()


def chunk_object(
    response: dict[str, Any],
    *,
    choices: list[ChunkChoice] | None = None,
    usage: dict[str, Any] | None = None,
    include_usage: bool = False,
    usage_only: bool = False,
) -> dict[str, Any]:
    """One `chat.completion.chunk`."""
    wire = ChatCompletionChunk(
        **_envelope(response),
        choices=[] if usage_only else list(choices or []),
        usage=chat_usage(usage) if usage_only else None,
    ).wire()
    if not include_usage:
        del wire["usage"]
    for choice in wire["choices"]:
        # A delta has only the keys it changes (`{"content": "…"}`, `{}` at the end).
        delta = {k: v for k, v in choice["delta"].items() if v is not None}
        for call in delta.get("tool_calls", []):
            for key in ("id", "type"):
                if call[key] is None:
                    del call[key]
            call["function"] = {k: v for k, v in call["function"].items() if v is not None}
        choice["delta"] = delta
    return wire
