"""Chat Completions on the wire: parsing `POST /chat/completions` bodies into a typed request, and
building the `chat.completion` and `chat.completion.chunk` objects (LMSP B5, for clients of the
older OpenAI API).

As with the Responses API (protocol/requests.py), a field the service cannot honour is refused
by name with a 400 rather than ignored; neutral values that SDKs and frameworks send by default
(`n: 1`, `frequency_penalty: 0`, `tools: []`, ...) are accepted. Error `param`s use the Chat
Completions names (`messages[2].content`, `max_tokens`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .errors import LMSPError, invalid
from .requests import (
    message_text,
    metadata_field,
    optional_field,
    refuse_unknown_fields,
    sampling_fields,
)

CHAT_FIELDS = {
    "model",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "seed",
    "stream",
    "stream_options",
    "n",
    "stop",
    "metadata",
    "store",
    # Labels and hints with no effect on the output: checked to be strings, then unused.
    "user",
    "safety_identifier",
    "prompt_cache_key",
}
# Accepted only with these values: they ask for nothing beyond what the service does anyway.
# A tuple lists the accepted values; null is always accepted.
NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (0,),
    "presence_penalty": (0,),
    "logprobs": (False,),
    "top_logprobs": (0,),
    "logit_bias": ({},),
    "tools": ([],),
    "functions": ([],),
    "tool_choice": ("none", "auto"),
    "function_call": ("none", "auto"),
    "parallel_tool_calls": (True, False),
    "response_format": ({"type": "text"},),
    "modalities": (["text"],),
    "service_tier": ("auto", "default"),
    "prediction": (),
    "audio": (),
    "web_search_options": (),
    "reasoning_effort": (),
    "verbosity": (),
}
ROLES = ("system", "developer", "user", "assistant")
MESSAGE_FIELDS = {"role", "content", "name"}
# Message keys the SDK's typed params allow, accepted only when empty.
NEUTRAL_MESSAGE_FIELDS = {"refusal", "tool_calls", "function_call", "audio"}
TEXT_PART_TYPES = ("text",)


@dataclass
class ChatRequest:
    model: str | None
    # As the engine takes them: role in system/user/assistant, content a string.
    messages: list[dict[str, str]]
    max_tokens: int | None
    temperature: float
    top_p: float
    seed: int
    stream: bool
    include_usage: bool
    metadata: dict[str, str] = field(default_factory=dict)


def parse_chat_request(body: dict[str, Any]) -> ChatRequest:
    refuse_unknown_fields(body, CHAT_FIELDS, NEUTRAL_VALUES, _neutral)

    model = optional_field(body, "model", str)
    if "messages" not in body:
        raise invalid(
            "'messages' is required.", param="messages", code="missing_required_parameter"
        )
    messages = parse_messages(body["messages"])

    max_tokens = optional_field(body, "max_tokens", int)
    max_completion_tokens = optional_field(body, "max_completion_tokens", int)
    for name, limit in (
        ("max_tokens", max_tokens),
        ("max_completion_tokens", max_completion_tokens),
    ):
        if limit is not None and limit < 1:
            raise invalid(f"'{name}' must be at least 1.", param=name)
    if (
        max_tokens is not None
        and max_completion_tokens is not None
        and max_tokens != max_completion_tokens
    ):
        raise invalid(
            "'max_tokens' and 'max_completion_tokens' disagree; give only one of them.",
            param="max_tokens",
        )
    limit = max_completion_tokens if max_completion_tokens is not None else max_tokens

    temperature, top_p, seed = sampling_fields(body)

    n = optional_field(body, "n", int)
    if n is not None and n != 1:
        raise LMSPError(
            400,
            "unsupported_parameter",
            "Only one choice per request is supported ('n': 1).",
            param="n",
        )
    stop = body.get("stop")
    if stop is not None and stop != []:
        # Stopping on a string needs the generation to end mid-token; the engine stops only
        # at the model's end-of-sequence token or the token limit.
        raise LMSPError(
            400,
            "unsupported_parameter",
            "'stop' sequences are not supported by this service; generation ends at the "
            "model's end-of-sequence token or at 'max_completion_tokens'.",
            param="stop",
        )
    if optional_field(body, "store", bool):
        raise LMSPError(
            400,
            "unsupported_parameter",
            "Stored chat completions ('store': true) are not supported; every chat completion "
            "is kept as an LMSP response, readable at /responses/{response_id}.",
            param="store",
        )
    for name in ("user", "safety_identifier", "prompt_cache_key"):
        optional_field(body, name, str)

    stream = bool(optional_field(body, "stream", bool) or False)
    options = optional_field(body, "stream_options", dict)
    if options is not None and not stream:
        raise invalid(
            "'stream_options' is only allowed with 'stream': true.", param="stream_options"
        )
    include_usage = False
    for name, value in (options or {}).items():
        if name == "include_usage" and (value is None or isinstance(value, bool)):
            include_usage = bool(value)
        elif name == "include_obfuscation" and (value is None or value is False):
            continue
        else:
            raise LMSPError(
                400,
                "unsupported_parameter",
                f"'stream_options.{name}' with this value is not supported.",
                param=f"stream_options.{name}",
            )

    metadata = metadata_field(body)
    return ChatRequest(
        model=model,
        messages=messages,
        max_tokens=limit,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        stream=stream,
        include_usage=include_usage,
        metadata=metadata,
    )


def parse_messages(value: Any) -> list[dict[str, str]]:
    """`messages`: roles system, developer (treated as system), user, assistant; content a string
    or a list of text parts."""
    if not isinstance(value, list) or not value:
        raise invalid("'messages' must be a non-empty list of messages.", param="messages")
    messages = []
    for i, item in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(item, dict):
            raise invalid(f"'{where}' must be an object.", param=where)
        role = item.get("role")
        if role in ("tool", "function"):
            raise LMSPError(
                400,
                "unsupported_input",
                f"'{where}.role' is '{role}'; tool calling is not supported.",
                param=f"{where}.role",
            )
        if role not in ROLES:
            raise invalid(
                f"'{where}.role' must be system, developer, user or assistant.",
                param=f"{where}.role",
            )
        for key, extra in item.items():
            if key in MESSAGE_FIELDS:
                continue
            if key in NEUTRAL_MESSAGE_FIELDS and extra in (None, []):
                continue
            code = "unsupported_parameter" if key in NEUTRAL_MESSAGE_FIELDS else "unknown_parameter"
            raise LMSPError(400, code, f"'{where}.{key}' is not supported.", param=f"{where}.{key}")
        name = item.get("name")
        if name is not None and not isinstance(name, str):
            raise invalid(
                f"'{where}.name' must be a string.", param=f"{where}.name", code="invalid_type"
            )
        messages.append(
            {
                "role": "system" if role == "developer" else role,
                "content": message_text(item, where, TEXT_PART_TYPES),
            }
        )
    return messages


def _neutral(name: str, value: Any) -> bool:
    allowed = NEUTRAL_VALUES[name]
    # Compared by kind as well as value: plain equality would let 0 pass for False and True
    # for 1, which a JSON Schema (and the caller) would not.
    return value is None or any(_kind(v) == _kind(value) and v == value for v in allowed)


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    return type(value).__name__


# ---------------------------------------------------------------------------------------------
# objects


def completion_id(response_id: str) -> str:
    """The chat completion's id, derived from its response's (`resp_X` → `chatcmpl-X`)."""
    return "chatcmpl-" + response_id.split("_", 1)[1]


def finish_reason(response: dict[str, Any]) -> str:
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


def chat_usage(usage: dict[str, Any] | None) -> dict[str, Any]:
    """A Responses `usage` object in the Chat Completions shape."""
    usage = usage or {}
    prompt = usage.get("input_tokens", 0)
    completion = usage.get("output_tokens", 0)
    cached = (usage.get("input_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached, "audio_tokens": 0},
        "completion_tokens_details": {
            "reasoning_tokens": 0,
            "audio_tokens": 0,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        },
    }


def _envelope(response: dict[str, Any], object_: str) -> dict[str, Any]:
    return {
        "id": completion_id(response["id"]),
        "object": object_,
        "created": response["created_at"],
        "model": response["model"],
        "system_fingerprint": None,
        "service_tier": None,
        # LMSP fields: where the work that produced it can be read.
        "response_id": response["id"],
        "task_id": response["task_id"],
        "seed": response.get("seed"),
    }


def completion_object(response: dict[str, Any]) -> dict[str, Any]:
    """The `chat.completion` for a finished (completed or incomplete) response object."""
    return {
        **_envelope(response, "chat.completion"),
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": output_text(response),
                    "refusal": None,
                    "annotations": [],
                },
                "logprobs": None,
                "finish_reason": finish_reason(response),
            }
        ],
        "usage": chat_usage(response.get("usage")),
    }


def chunk_object(
    response: dict[str, Any],
    *,
    delta: dict[str, Any] | None = None,
    finish: str | None = None,
    usage: dict[str, Any] | None = None,
    include_usage: bool = False,
    usage_only: bool = False,
) -> dict[str, Any]:
    """One `chat.completion.chunk`. With `include_usage`, every chunk has `usage` (null but
    in the last one, whose `choices` is empty), as the OpenAI API sends them."""
    chunk = _envelope(response, "chat.completion.chunk")
    chunk["choices"] = (
        []
        if usage_only
        else [{"index": 0, "delta": delta or {}, "logprobs": None, "finish_reason": finish}]
    )
    if include_usage:
        chunk["usage"] = chat_usage(usage) if usage_only else None
    return chunk
