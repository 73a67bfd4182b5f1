"""Parsing and validating request bodies into typed requests, with precise 400s (LMSP B5).

Anything the service does not support (tools, for example) is refused by name rather than
ignored, so a caller never believes a field took effect when it did not.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from .errors import LMSPError, invalid
from .states import RestartPolicy

RESPONSE_FIELDS = {
    "model",
    "input",
    "instructions",
    "max_output_tokens",
    "temperature",
    "top_p",
    "stream",
    "background",
    "store",
    "previous_response_id",
    "metadata",
    "seed",
    "on_restart",
}
# Accepted when they ask for nothing beyond what the service does anyway.
HARMLESS_DEFAULTS: dict[str, Any] = {
    "tools": [],
    "tool_choice": ("none", "auto"),
    "parallel_tool_calls": (False, True),
    "truncation": ("disabled",),
    "user": None,
    "stream_options": None,
    "include": [],
    "text": {"format": {"type": "text"}},
}

MAX_METADATA_KEYS = 16
MAX_SEED = 2**63


@dataclass
class ResponseRequest:
    model: str | None
    messages: list[dict[str, str]]
    instructions: str | None
    max_output_tokens: int | None
    temperature: float
    top_p: float
    seed: int
    stream: bool
    background: bool
    store: bool
    previous_response_id: str | None
    metadata: dict[str, str]
    on_restart: RestartPolicy
    raw_input: Any = None
    explicit: dict[str, Any] = field(default_factory=dict)

    def stored_request(self) -> dict[str, Any]:
        """What the response object echoes back, and what the task needs to run again."""
        return {
            "input": self.raw_input,
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "stream": self.stream,
            "background": self.background,
            "metadata": self.metadata,
        }


def parse_json_body(body: bytes) -> dict[str, Any]:
    if not body:
        raise invalid("The request body is empty; a JSON object is expected.", code="invalid_json")
    try:
        value = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise invalid(f"The request body is not valid JSON: {e}", code="invalid_json") from e
    if not isinstance(value, dict):
        raise invalid("The request body must be a JSON object.", code="invalid_json")
    return value


def parse_response_request(body: dict[str, Any]) -> ResponseRequest:
    refuse_unknown_fields(body, RESPONSE_FIELDS, HARMLESS_DEFAULTS, _harmless)

    model = optional_field(body, "model", str)
    if "input" not in body:
        raise invalid("'input' is required.", param="input", code="missing_required_parameter")
    messages = parse_input(body["input"])
    instructions = optional_field(body, "instructions", str)
    max_output_tokens = optional_field(body, "max_output_tokens", int)
    if max_output_tokens is not None and max_output_tokens < 1:
        raise invalid("'max_output_tokens' must be at least 1.", param="max_output_tokens")
    temperature, top_p, seed = sampling_fields(body)
    stream = bool(optional_field(body, "stream", bool) or False)
    background = bool(optional_field(body, "background", bool) or False)
    store = optional_field(body, "store", bool)
    store = True if store is None else store
    if background and not store:
        raise invalid("A background response must be stored ('store': true).", param="store")
    previous = optional_field(body, "previous_response_id", str)
    metadata = metadata_field(body)
    policy_name = optional_field(body, "on_restart", str)
    if policy_name is None:
        policy = RestartPolicy.RESUME if background else RestartPolicy.FAIL
    else:
        try:
            policy = RestartPolicy(policy_name)
        except ValueError:
            raise invalid(
                "'on_restart' must be one of 'fail', 'retry', 'resume'.", param="on_restart"
            ) from None
    return ResponseRequest(
        model=model,
        messages=messages,
        instructions=instructions,
        max_output_tokens=max_output_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        stream=stream,
        background=background,
        store=store,
        previous_response_id=previous,
        metadata=metadata,
        on_restart=policy,
        raw_input=body["input"],
    )


# ---------------------------------------------------------------------------------------------
# what Responses and Chat Completions requests share


def refuse_unknown_fields(
    body: dict[str, Any],
    known: Collection[str],
    limited: Collection[str],
    accepted: Callable[[str, Any], bool],
) -> None:
    """400 for a field outside `known`, or one of the `limited` fields (those accepted only
    with values that change nothing) with a value `accepted(name, value)` refuses."""
    for name, value in body.items():
        if name in known:
            continue
        if name in limited:
            if accepted(name, value):
                continue
            raise LMSPError(
                400,
                "unsupported_parameter",
                f"The parameter '{name}' with this value is not supported by this service.",
                param=name,
            )
        raise LMSPError(400, "unknown_parameter", f"Unknown parameter: '{name}'.", param=name)


def sampling_fields(body: dict[str, Any]) -> tuple[float, float, int]:
    """`temperature`, `top_p` and `seed`. A seed is always chosen when none is given, so every
    run (a resumed one too) is reproducible from its stored request."""
    temperature = number_field(body, "temperature", 1.0, 0.0, 2.0)
    top_p = number_field(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0.0:
        raise invalid("'top_p' must be greater than 0.", param="top_p")
    seed = optional_field(body, "seed", int)
    if seed is not None and not 0 <= seed < MAX_SEED:
        raise invalid("'seed' must be between 0 and 2**63-1.", param="seed")
    return temperature, top_p, seed if seed is not None else secrets.randbits(31)


def metadata_field(body: dict[str, Any]) -> dict[str, str]:
    metadata = optional_field(body, "metadata", dict) or {}
    if len(metadata) > MAX_METADATA_KEYS or not all(
        isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
        for k, v in metadata.items()
    ):
        raise invalid(
            "'metadata' is at most 16 string keys (64 chars) with string values (512 chars).",
            param="metadata",
        )
    return metadata


def parse_input(value: Any) -> list[dict[str, str]]:
    """`input` as a string or a list of messages (any form the openai SDK sends)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise invalid("'input' must be a string or a non-empty list of messages.", param="input")
    messages = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise invalid(f"'input[{i}]' must be an object.", param=f"input[{i}]")
        kind = item.get("type", "message")
        if kind != "message":
            raise LMSPError(
                400,
                "unsupported_input",
                f"'input[{i}]' has type '{kind}'; only messages are supported.",
                param=f"input[{i}].type",
            )
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise invalid(
                f"'input[{i}].role' must be user, assistant, system or developer.",
                param=f"input[{i}].role",
            )
        messages.append(
            {
                "role": "system" if role == "developer" else role,
                "content": message_text(item, f"input[{i}]", INPUT_TEXT_PART_TYPES),
            }
        )
    return messages


INPUT_TEXT_PART_TYPES = ("input_text", "output_text", "text")


def message_text(item: dict[str, Any], where: str, part_types: tuple[str, ...]) -> str:
    """A message's `content` as one string: a string, or a list of text parts (of
    `part_types`) joined; anything else is a 400 naming the part (`where` is its path)."""
    content = item.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if (
                isinstance(part, dict)
                and part.get("type") in part_types
                and isinstance(part.get("text"), str)
            ):
                texts.append(part["text"])
            else:
                raise LMSPError(
                    400,
                    "unsupported_input",
                    f"'{where}.content[{j}]' must be a text part (type "
                    f"{' or '.join(repr(t) for t in part_types)}); other kinds are not supported.",
                    param=f"{where}.content[{j}]",
                )
        return "".join(texts)
    raise invalid(
        f"'{where}.content' must be a string or a list of text parts.", param=f"{where}.content"
    )


def _harmless(name: str, value: Any) -> bool:
    allowed = HARMLESS_DEFAULTS[name]
    if isinstance(allowed, tuple):
        # Same type as well as equal: `0 in (False, True)` is true in Python, not in JSON.
        return any(type(value) is type(v) and value == v for v in allowed)
    return value == allowed or value is None


def optional_field(body: dict[str, Any], name: str, kind: type) -> Any:
    """`body[name]` if present and of `kind` (an integral float counts as an int), else a 400."""
    value = body.get(name)
    if value is None:
        return None
    if kind is int and isinstance(value, float) and value.is_integer():
        return int(value)  # JSON (and JSON Schema) make no difference between 8 and 8.0
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise invalid(f"'{name}' must be an integer.", param=name, code="invalid_type")
    if not isinstance(value, kind):
        raise invalid(f"'{name}' must be of type {kind.__name__}.", param=name, code="invalid_type")
    return value


def number_field(body: dict[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    """`body[name]` as a number within [lo, hi], `default` if absent, else a 400."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise invalid(f"'{name}' must be a number.", param=name, code="invalid_type")
    if not lo <= value <= hi:
        raise invalid(f"'{name}' must be between {lo} and {hi}.", param=name)
    return float(value)
