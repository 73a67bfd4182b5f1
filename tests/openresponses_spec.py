"""The Open Responses spec's required fields and their types, written here from its OpenAPI
document (`openresponses/openresponses`, `public/openapi/openapi.json`, version 2026-04-24):
`ResponseResource`, the output items, and every streaming event the service sends.

`problems(value, shape)` lists what in `value` the spec would refuse: a missing required field,
a wrong type (an integer field that is null, a string enum outside its values). Fields beyond
the spec's are allowed, as the spec's own validator (zod objects) allows them.
"""

from __future__ import annotations

from typing import Any

# A shape: a dict of field -> type. A type is a Python type or tuple of types (None for JSON
# null), a tuple of allowed string values ("enum", ...), a nested shape (dict), ("list", type),
# ("item",) for an output item, or ("nullable", type).
Shape = dict[str, Any]

NUMBER = (int, float)
STR_OR_NULL = ("nullable", str)
INT_OR_NULL = ("nullable", int)

USAGE: Shape = {
    "input_tokens": int,
    "output_tokens": int,
    "total_tokens": int,
    "input_tokens_details": {"cached_tokens": int},
    "output_tokens_details": {"reasoning_tokens": int},
}

OUTPUT_TEXT: Shape = {"type": ("enum", "output_text"), "text": str, "annotations": ("list", dict)}

MESSAGE: Shape = {
    "type": ("enum", "message"),
    "id": str,
    "status": ("enum", "in_progress", "completed", "incomplete"),
    "role": ("enum", "user", "assistant", "system", "developer"),
    "content": ("list", OUTPUT_TEXT),
}

FUNCTION_CALL: Shape = {
    "type": ("enum", "function_call"),
    "id": str,
    "call_id": str,
    "name": str,
    "arguments": str,
    "status": ("enum", "in_progress", "completed", "incomplete"),
}

FUNCTION_TOOL: Shape = {
    "type": ("enum", "function"),
    "name": str,
    "description": STR_OR_NULL,
    "parameters": ("nullable", dict),
    "strict": ("nullable", bool),
}

TEXT_FORMAT_TYPES = ("enum", "text", "json_object", "json_schema")

RESPONSE: Shape = {
    "id": str,
    "object": ("enum", "response"),
    "created_at": int,
    "completed_at": INT_OR_NULL,
    "status": str,
    "incomplete_details": ("nullable", {"reason": str}),
    "model": str,
    "previous_response_id": STR_OR_NULL,
    "instructions": STR_OR_NULL,
    "output": ("list", ("item",)),
    "error": ("nullable", {"code": str, "message": str}),
    "tools": ("list", FUNCTION_TOOL),
    "tool_choice": ("tool_choice",),
    "truncation": ("enum", "auto", "disabled"),
    "parallel_tool_calls": bool,
    "text": {"format": {"type": TEXT_FORMAT_TYPES}},
    "top_p": NUMBER,
    "presence_penalty": NUMBER,
    "frequency_penalty": NUMBER,
    "top_logprobs": int,
    "temperature": NUMBER,
    "reasoning": (
        "nullable",
        {
            "effort": ("nullable", ("enum", "none", "low", "medium", "high", "xhigh")),
            "summary": ("nullable", ("enum", "concise", "detailed", "auto")),
        },
    ),
    "usage": ("nullable", USAGE),
    "max_output_tokens": INT_OR_NULL,
    "max_tool_calls": INT_OR_NULL,
    "store": bool,
    "background": bool,
    "service_tier": str,
    "metadata": ("any",),
    "safety_identifier": STR_OR_NULL,
    "prompt_cache_key": STR_OR_NULL,
}


def _lifecycle(kind: str) -> Shape:
    return {"type": ("enum", kind), "sequence_number": int, "response": RESPONSE}


def _item_event(kind: str) -> Shape:
    return {
        "type": ("enum", kind),
        "sequence_number": int,
        "output_index": int,
        "item": ("nullable", ("item",)),
    }


def _part_event(kind: str) -> Shape:
    return {
        "type": ("enum", kind),
        "sequence_number": int,
        "item_id": str,
        "output_index": int,
        "content_index": int,
        "part": OUTPUT_TEXT,
    }


EVENTS: dict[str, Shape] = {
    **{
        kind: _lifecycle(kind)
        for kind in (
            "response.created",
            "response.queued",
            "response.in_progress",
            "response.completed",
            "response.failed",
            "response.incomplete",
        )
    },
    "response.output_item.added": _item_event("response.output_item.added"),
    "response.output_item.done": _item_event("response.output_item.done"),
    "response.content_part.added": _part_event("response.content_part.added"),
    "response.content_part.done": _part_event("response.content_part.done"),
    "response.output_text.delta": {
        "type": ("enum", "response.output_text.delta"),
        "sequence_number": int,
        "item_id": str,
        "output_index": int,
        "content_index": int,
        "delta": str,
    },
    "response.output_text.done": {
        "type": ("enum", "response.output_text.done"),
        "sequence_number": int,
        "item_id": str,
        "output_index": int,
        "content_index": int,
        "text": str,
    },
    "response.function_call_arguments.delta": {
        "type": ("enum", "response.function_call_arguments.delta"),
        "sequence_number": int,
        "item_id": str,
        "output_index": int,
        "delta": str,
    },
    "response.function_call_arguments.done": {
        "type": ("enum", "response.function_call_arguments.done"),
        "sequence_number": int,
        "item_id": str,
        "output_index": int,
        "arguments": str,
    },
    "error": {"type": ("enum", "error"), "sequence_number": int, "error": dict},
}

TERMINAL = ("response.completed", "response.failed", "response.incomplete")


def problems(value: Any, shape: Any, path: str = "") -> list[str]:
    """What in `value` does not match `shape` (empty when it matches)."""
    if isinstance(shape, dict):
        if not isinstance(value, dict):
            return [f"{path or '.'}: expected an object, got {value!r}"]
        out: list[str] = []
        for name, kind in shape.items():
            if name not in value:
                out.append(f"{path}.{name}: required, missing")
            else:
                out.extend(problems(value[name], kind, f"{path}.{name}"))
        return out
    if isinstance(shape, tuple) and shape and isinstance(shape[0], str):
        tag = shape[0]
        if tag == "any":
            return []
        if tag == "nullable":
            return [] if value is None else problems(value, shape[1], path)
        if tag == "enum":
            ok = isinstance(value, str) and value in shape[1:]
            return [] if ok else [f"{path}: {value!r} not one of {shape[1:]}"]
        if tag == "list":
            if not isinstance(value, list):
                return [f"{path}: expected a list, got {value!r}"]
            return [p for i, v in enumerate(value) for p in problems(v, shape[1], f"{path}[{i}]")]
        if tag == "item":
            kinds = {"message": MESSAGE, "function_call": FUNCTION_CALL}
            kind = value.get("type") if isinstance(value, dict) else None
            if kind not in kinds:
                return [f"{path}: not an output item the spec knows: {value!r}"]
            return problems(value, kinds[kind], path)
        if tag == "tool_choice":
            if value in ("none", "auto", "required"):
                return []
            if isinstance(value, dict) and value.get("type") == "function":
                return problems(value, {"type": ("enum", "function")}, path)
            if isinstance(value, dict) and value.get("type") == "allowed_tools":
                return problems(
                    value,
                    {
                        "type": ("enum", "allowed_tools"),
                        "tools": ("list", {"type": ("enum", "function")}),
                        "mode": ("enum", "none", "auto", "required"),
                    },
                    path,
                )
            return [f"{path}: not a tool choice: {value!r}"]
    # A Python type (or types): JSON's, where a bool is not a number.
    types = shape if isinstance(shape, tuple) else (shape,)
    if isinstance(value, bool) and bool not in types:
        return [f"{path}: expected {shape}, got {value!r}"]
    if isinstance(value, types):
        return []
    return [f"{path}: expected {shape}, got {value!r}"]


def event_problems(event: dict[str, Any]) -> list[str]:
    """What the spec would refuse in a streamed event (an unknown type among them)."""
    kind = event.get("type")
    if kind not in EVENTS:
        return [f"{kind}: not an event type of the spec"]
    return problems(event, EVENTS[kind], str(kind))
