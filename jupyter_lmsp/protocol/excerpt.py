"""What a task list says about each response task (issue 40): the start of its prompt, why it
is incomplete, its output tokens, read from the task's stored response.

The excerpt is the response's first user message of its own input (not the earlier turns of
its conversation, which every turn of a conversation shares), whitespace collapsed, cut at a
word to at most PROMPT_EXCERPT_LENGTH characters with '…'.
"""

from __future__ import annotations

import json
from typing import Any

from .stored_request import own_input
from .tasks import PROMPT_EXCERPT_LENGTH


def _text(content: Any) -> str:
    """A message's text: a string, or the text parts of a list of parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return ""


def shorten(text: str, limit: int = PROMPT_EXCERPT_LENGTH) -> str:
    """`text` with its whitespace collapsed, cut at the last space within `limit` characters
    (or mid-word when one word is longer than that) and ended with '…'."""
    flat = " ".join(text.split())
    if len(flat) <= limit:
        return flat
    cut = flat[: limit - 1]
    space = cut.rfind(" ")
    if space >= limit // 2:
        cut = cut[:space]
    return cut.rstrip() + "…"


def input_messages(request: dict[str, Any], params: dict[str, Any]) -> list[dict[str, Any]]:
    """The messages of the request's own input (also from rows of the older layout, which kept
    them in the task's params)."""
    own = own_input(request)
    if own is not None:
        return own
    found = params.get("input_messages", params.get("messages", []))
    return list(found) if isinstance(found, list) else []


def prompt_excerpt(request_json: str, params_json: str) -> str | None:
    """The start of the first user message of the input (else of any message with text, else
    the instructions); None when there is no text at all."""
    request = json.loads(request_json)
    messages = [m for m in input_messages(request, json.loads(params_json)) if isinstance(m, dict)]
    users = [m for m in messages if m.get("role") == "user"]
    for message in users + messages:
        text = _text(message.get("content"))
        if text.strip():
            return shorten(text)
    instructions = request.get("instructions")
    if isinstance(instructions, str) and instructions.strip():
        return shorten(instructions)
    return None


def output_tokens(usage_json: str | None) -> int | None:
    if not usage_json:
        return None
    tokens = json.loads(usage_json).get("output_tokens")
    return tokens if isinstance(tokens, int) else None
