"""Chat Completions on the wire (LMSP B5, for clients of the older OpenAI API): the
`POST /chat/completions` body, and the `chat.completion` and `chat.completion.chunk` objects.

As with the Responses API, a field the service cannot honour is refused by name with a 400
rather than ignored; neutral values that SDKs and frameworks send by default (`n: 1`,
`frequency_penalty: 0`, `tools: []`, ...) are accepted. Error `param`s use the Chat Completions
names (`messages[2].content`, `max_tokens`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, Tag, model_validator

from .fields import (
    Body,
    Label,
    Metadata,
    Neutral,
    Seed,
    Temperature,
    TokenLimit,
    TopP,
    WireObject,
    by_json_type,
    optional_on_wire,
    refuse,
)


def _no_tool_roles(value: Any) -> Any:
    if value in ("tool", "function"):
        raise refuse(
            "unsupported_input", "'{param}' is '" + value + "'; tool calling is not supported."
        )
    return value


def _text_parts_only(value: Any) -> Any:
    if isinstance(value, dict) and value.get("type") != "text":
        raise refuse(
            "unsupported_input",
            "'{param}' must be a text part (type 'text'); other kinds are not supported.",
        )
    return value


class ChatTextPart(Body):
    type: Literal["text"]
    text: str


class ChatMessage(Body):
    role: Annotated[
        Literal["system", "developer", "user", "assistant"],
        BeforeValidator(_no_tool_roles),
        Field(description="`developer` is treated as `system`."),
    ]
    content: Annotated[
        Annotated[str, Tag("string")]
        | Annotated[list[Annotated[ChatTextPart, BeforeValidator(_text_parts_only)]], Tag("array")],
        by_json_type("a string or a list of text parts"),
    ]
    name: str | None = None
    # What the openai SDK's typed assistant messages may carry, accepted only when empty.
    tool_calls: Annotated[Any, Neutral([])] = None
    function_call: Annotated[Any, Neutral([])] = None
    refusal: Annotated[Any, Neutral([])] = None
    audio: Annotated[Any, Neutral([])] = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


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
    prompt_cache_key: Label | None = None
    # Accepted only with neutral values, most significant first.
    tools: Annotated[Any, Neutral([])] = None
    tool_choice: Annotated[Any, Neutral("none", "auto")] = None
    functions: Annotated[Any, Neutral([])] = None
    function_call: Annotated[Any, Neutral("none", "auto")] = None
    parallel_tool_calls: bool | None = None
    response_format: Annotated[Any, Neutral({"type": "text"})] = None
    n: Annotated[Any, Neutral(1, message="Only one choice per request is supported ('n': 1).")] = (
        None
    )
    stop: Annotated[
        Any,
        Neutral(
            [],
            # Stopping on a string needs the generation to end mid-token; the engine stops
            # only at the model's end-of-sequence token or the token limit.
            message="'stop' sequences are not supported by this service; generation ends at "
            "the model's end-of-sequence token or at 'max_completion_tokens'.",
        ),
    ] = None
    logprobs: Annotated[Any, Neutral(False)] = None
    top_logprobs: Annotated[Any, Neutral(0)] = None
    logit_bias: Annotated[Any, Neutral({})] = None
    frequency_penalty: Annotated[Any, Neutral(0)] = None
    presence_penalty: Annotated[Any, Neutral(0)] = None
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
    reasoning_effort: Annotated[Any, Neutral()] = None
    verbosity: Annotated[Any, Neutral()] = None
    service_tier: Annotated[Any, Neutral("auto", "default")] = None
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
        return self

    model_config = {
        "json_schema_extra": {
            # `stream_options` (not null) only with `stream: true`.
            "if": {
                "required": ["stream_options"],
                "properties": {"stream_options": {"type": "object"}},
            },
            "then": {"required": ["stream"], "properties": {"stream": {"const": True}}},
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

    def engine_messages(self) -> list[dict[str, str]]:
        """As the engine takes them: role in system/user/assistant, content a string."""
        return [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for m in self.messages
        ]


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


class ChatUsage(WireObject):
    prompt_tokens: Annotated[int, Field(ge=0)]
    completion_tokens: Annotated[int, Field(ge=0)]
    total_tokens: Annotated[int, Field(ge=0)]
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails


class AssistantMessage(WireObject):
    role: Literal["assistant"] = "assistant"
    content: str
    refusal: None = None
    annotations: list[Any] = Field(default_factory=list)


FinishReason = Literal["stop", "length"]


class Choice(WireObject):
    index: Literal[0] = 0
    message: AssistantMessage
    logprobs: None = None
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
    choices: Annotated[list[Choice], Field(min_length=1, max_length=1)]
    usage: ChatUsage


class ChunkDelta(WireObject):
    role: Literal["assistant"] | None = None
    content: str | None = None

    model_config = {"json_schema_extra": optional_on_wire("role", "content")}


class ChunkChoice(WireObject):
    index: Literal[0] = 0
    delta: ChunkDelta
    logprobs: None = None
    finish_reason: FinishReason | None


class ChatCompletionChunk(_ChatEnvelope):
    """One `data:` line of a chat stream (which ends with `data: [DONE]`). With
    `include_usage`, every chunk has `usage`, null but in the last (whose `choices` is empty);
    without it, none has."""

    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: Annotated[list[ChunkChoice], Field(max_length=1)]
    usage: ChatUsage | None = None

    model_config = {"json_schema_extra": optional_on_wire("usage")}


def completion_id(response_id: str) -> str:
    """The chat completion's id, derived from its response's (`resp_X` → `chatcmpl-X`)."""
    return "chatcmpl-" + response_id.split("_", 1)[1]


def finish_reason(response: dict[str, Any]) -> FinishReason:
    details = response.get("incomplete_details") or {}
    return "length" if details.get("reason") == "max_output_tokens" else "stop"


def output_text(response: dict[str, Any]) -> str:
    return "".join(
        part.get("text", "")
        for item in response.get("output", [])
        if item.get("type") == "message"
        for part in item.get("content", [])
        if part.get("type") == "output_text"
    )


def chat_usage(usage: dict[str, Any] | None) -> ChatUsage:
    """A Responses `usage` object in the Chat Completions shape."""
    usage = usage or {}
    prompt = usage.get("input_tokens", 0)
    completion = usage.get("output_tokens", 0)
    cached = (usage.get("input_tokens_details") or {}).get("cached_tokens", 0)
    return ChatUsage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached, audio_tokens=0),
        completion_tokens_details=CompletionTokensDetails(
            reasoning_tokens=0,
            audio_tokens=0,
            accepted_prediction_tokens=0,
            rejected_prediction_tokens=0,
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


def completion_object(response: dict[str, Any]) -> dict[str, Any]:
    """The `chat.completion` for a finished (completed or incomplete) response object."""
    return ChatCompletion(
        **_envelope(response),
        choices=[
            Choice(
                message=AssistantMessage(content=output_text(response)),
                finish_reason=finish_reason(response),
            )
        ],
        usage=chat_usage(response.get("usage")),
    ).wire()


def chunk_object(
    response: dict[str, Any],
    *,
    delta: ChunkDelta | None = None,
    finish: FinishReason | None = None,
    usage: dict[str, Any] | None = None,
    include_usage: bool = False,
    usage_only: bool = False,
) -> dict[str, Any]:
    """One `chat.completion.chunk`."""
    wire = ChatCompletionChunk(
        **_envelope(response),
        choices=[]
        if usage_only
        else [ChunkChoice(delta=delta or ChunkDelta(), finish_reason=finish)],
        usage=chat_usage(usage) if usage_only else None,
    ).wire()
    if not include_usage:
        del wire["usage"]
    for choice in wire["choices"]:
        # A delta has only the keys it changes (`{"content": "…"}`, `{}` at the end).
        choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
    return wire
