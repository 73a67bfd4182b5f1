"""The `input` of `POST /responses` (LMSP B5): the items a request may give — messages with
text content (the forms the openai SDK sends), function and custom tool calls the model made
earlier (with the namespace their call item named), their outputs, and compaction items — and
those items as the chat messages the engine takes. Other item and content kinds are refused by name
(`unsupported_input`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Discriminator, Field, Tag

from .fields import Body, Neutral, Role, by_json_type, refuse

INPUT_TEXT_PART_TYPES = ("input_text", "output_text", "text")


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


# A message's content or a call's output: a string, or a list of text parts.
TextContent = Annotated[
    Annotated[str, Tag("string")]
    | Annotated[list[Annotated[InputTextPart, BeforeValidator(_text_parts_only)]], Tag("array")],
    by_json_type("a string or a list of text parts"),
]


class InputMessage(Body):
    """A message of `input`: the forms the openai SDK sends (EasyInputMessage, a typed message,
    an output message sent back)."""

    type: Literal["message"] = "message"
    role: Annotated[Role, Field(description="`developer` is treated as `system`.")]
    content: TextContent
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: Literal["commentary", "final_answer"] | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class InputFunctionCall(Body):
    """A function call the model made earlier (an output item sent back as input)."""

    type: Literal["function_call"]
    call_id: Annotated[str, Field(min_length=1)]
    name: str
    arguments: str = Field(description="The JSON text of the call's arguments.")
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    namespace: str | None = Field(
        None, description="The namespace tool the function is in, as the call item said."
    )
    caller: Annotated[Any, Neutral({"type": "direct"})] = None
    async_: Annotated[Any, Neutral(False)] = Field(None, alias="async")


class InputFunctionCallOutput(Body):
    """What a function call returned: its `output` (text) for the call with `call_id`."""

    type: Literal["function_call_output"]
    call_id: Annotated[str, Field(min_length=1)]
    output: TextContent
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    name: str | None = None
    namespace: Annotated[Any, Neutral()] = None
    caller: Annotated[Any, Neutral({"type": "direct"})] = None

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(part.text for part in self.output)


class InputCustomToolCall(Body):
    """A custom tool call the model made earlier (an output item sent back as input)."""

    type: Literal["custom_tool_call"]
    call_id: Annotated[str, Field(min_length=1)]
    name: str
    input: str = Field(description="The text the model wrote for the tool.")
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    namespace: str | None = None
    caller: Annotated[Any, Neutral({"type": "direct"})] = None
    async_: Annotated[Any, Neutral(False)] = Field(None, alias="async")


class InputCustomToolCallOutput(Body):
    """What a custom tool call returned: its `output` (text) for the call with `call_id`."""

    type: Literal["custom_tool_call_output"]
    call_id: Annotated[str, Field(min_length=1)]
    output: TextContent
    id: str | None = None
    caller: Annotated[Any, Neutral({"type": "direct"})] = None

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(part.text for part in self.output)


class ReasoningTextPart(Body):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class InputReasoning(Body):
    """A reasoning item the model produced earlier, sent back (Codex and the openai-agents SDK
    do): its thinking joins the assistant turn after it (`reasoning_content`, which a thinking
    model's template may show it). `encrypted_content` is the text as this service sealed it
    (`include: ["reasoning.encrypted_content"]`); opened by the service before anything else
    reads the messages."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningTextPart] = Field(default_factory=list)
    content: list[ReasoningTextPart] | None = None
    encrypted_content: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        return "".join(part.text for part in self.content or [])


class InputCompaction(Body):
    """A compaction item `POST /responses/compact` returned, sent back as input: its sealed
    summary stands for the turns it replaced (opened by the service; `services.summaries`)."""

    type: Literal["compaction"]
    encrypted_content: Annotated[str, Field(min_length=1)]
    id: str | None = None
    created_by: str | None = None


# The key an engine message from a compaction item holds its sealed summary under, and the
# param naming it (the service opens it before anything else reads the messages).
COMPACTION_KEY = "compaction"
COMPACTION_PARAM_KEY = "compaction_param"
# The key an assistant message holds the sealed thinking of a reasoning item under, and its
# param (opened into `reasoning_content` by the service, as a compaction is).
SEALED_REASONING_KEY = "sealed_reasoning"
SEALED_REASONING_PARAM_KEY = "sealed_reasoning_param"

INPUT_ITEM_TYPES = (
    "message",
    "function_call",
    "function_call_output",
    "custom_tool_call",
    "custom_tool_call_output",
    "reasoning",
    "compaction",
)


def _input_item_kind(value: Any) -> str | None:
    if not isinstance(value, dict):
        return None
    kind = value.get("type", "message")
    return kind if kind in INPUT_ITEM_TYPES else "other"


def _supported_items_only(value: Any) -> Any:
    if isinstance(value, dict) and value.get("type", "message") not in INPUT_ITEM_TYPES:
        raise refuse(
            "unsupported_input",
            "'{param}' is '" + str(value.get("type")) + "'; only messages, function and custom "
            "tool calls, their outputs, reasoning and compaction items are supported.",
        )
    return value


InputItemParam = Annotated[
    Annotated[InputMessage, Tag("message")]
    | Annotated[InputFunctionCall, Tag("function_call")]
    | Annotated[InputFunctionCallOutput, Tag("function_call_output")]
    | Annotated[InputCustomToolCall, Tag("custom_tool_call")]
    | Annotated[InputCustomToolCallOutput, Tag("custom_tool_call_output")]
    | Annotated[InputReasoning, Tag("reasoning")]
    | Annotated[InputCompaction, Tag("compaction")],
    Discriminator(
        _input_item_kind,
        custom_error_type="invalid_value",
        custom_error_message="'{param}' must be a message, a function or custom tool call, its "
        "output or a compaction item",
    ),
    BeforeValidator(_supported_items_only),
]


def engine_messages(items: list[Any], param: str = "input") -> list[dict[str, Any]]:
    """Input items as chat messages: function and custom tool calls join the assistant message
    before them (`tool_calls`; a custom call has `input` for `arguments`), their outputs become
    `tool` messages (`custom` for a custom tool's); a compaction item becomes a user
    message holding its sealed summary under `COMPACTION_KEY`, for the service to open."""
    out: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        if isinstance(item, InputCompaction):
            out.append(
                {
                    "role": "user",
                    "content": "",
                    COMPACTION_KEY: item.encrypted_content,
                    COMPACTION_PARAM_KEY: f"{param}[{index}].encrypted_content",
                }
            )
        elif isinstance(item, InputReasoning):
            # The thinking belongs to the assistant turn that follows it.
            out.append({"role": "assistant", "content": "", "reasoning_content": item.text()})
            if item.encrypted_content:
                out[-1][SEALED_REASONING_KEY] = item.encrypted_content
                out[-1][SEALED_REASONING_PARAM_KEY] = f"{param}[{index}].encrypted_content"
        elif isinstance(item, InputFunctionCall | InputCustomToolCall):
            call: dict[str, Any] = {"id": item.call_id, "name": item.name}
            if isinstance(item, InputCustomToolCall):
                call["input"] = item.input
            else:
                call["arguments"] = item.arguments
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif isinstance(item, InputFunctionCallOutput):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
        elif isinstance(item, InputCustomToolCallOutput):
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": item.call_id,
                    "content": item.text(),
                    "custom": True,
                }
            )
        else:
            role = "system" if item.role == "developer" else item.role
            last = out[-1] if out else None
            if (
                role == "assistant"
                and last is not None
                and last["role"] == "assistant"
                and "reasoning_content" in last
                and not last["content"]
                and not last.get("tool_calls")
            ):
                # The answer after its reasoning item: one assistant turn.
                last["content"] = item.text()
            else:
                out.append({"role": role, "content": item.text()})
    return out
