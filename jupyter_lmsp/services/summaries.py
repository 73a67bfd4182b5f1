"""Compaction summaries in a conversation: the sealed content of a `compaction` item opened into
the message the model reads in place of the turns it replaced (`services.compaction` writes
them).

The summary is a user message that says what it is, as coding agents insert their own
summaries: the model reads it as context handed to it, not as something it said.
"""

from __future__ import annotations

from typing import Any

from ..protocol.response_input import (
    COMPACTION_KEY,
    COMPACTION_PARAM_KEY,
    SEALED_REASONING_KEY,
    SEALED_REASONING_PARAM_KEY,
)
from .sealing import Sealer

# What a compaction item is sealed as (the associated data: no other sealed kind opens as it).
KIND = "compaction"
# What a reasoning item's thinking is sealed as (`include: ["reasoning.encrypted_content"]`).
REASONING_KIND = "reasoning"
SUMMARY_PREFIX = (
    "Summary of the earlier conversation (it replaces the turns before this message; the "
    "user's own messages are kept above):\n\n"
)


def summary_message(summary: str) -> dict[str, Any]:
    return {"role": "user", "content": SUMMARY_PREFIX + summary}


def is_summary(message: dict[str, Any]) -> bool:
    content = message.get("content")
    return (
        message.get("role") == "user"
        and isinstance(content, str)
        and content.startswith(SUMMARY_PREFIX)
    )


def open_compactions(sealer: Sealer | None, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with each compaction item's message (`engine_messages`) replaced by the
    summary it seals, and each reasoning item's sealed thinking opened into its assistant
    turn's `reasoning_content`; a 400 naming the item for one this service did not seal, or
    altered."""
    if not any(COMPACTION_KEY in m or SEALED_REASONING_KEY in m for m in messages):
        return messages
    assert sealer is not None, "the service context has no sealer"
    opened = []
    for message in messages:
        if COMPACTION_KEY in message:
            content = sealer.unseal(KIND, message[COMPACTION_KEY], message[COMPACTION_PARAM_KEY])
            message = summary_message(str(content.get("summary", "")))
        elif SEALED_REASONING_KEY in message:
            content = sealer.unseal(
                REASONING_KIND,
                message[SEALED_REASONING_KEY],
                message[SEALED_REASONING_PARAM_KEY],
            )
            message = {
                k: v
                for k, v in message.items()
                if k not in (SEALED_REASONING_KEY, SEALED_REASONING_PARAM_KEY)
            }
            message["reasoning_content"] = str(content.get("text", ""))
        opened.append(message)
    return opened


def seal_reasoning(sealer: Sealer, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Output items with each reasoning item's thinking sealed into `encrypted_content`, for
    a client that included `reasoning.encrypted_content` (it sends the item back, and the
    next turn's prompt holds the same thinking)."""
    out = []
    for item in items:
        if item.get("type") == "reasoning":
            text = "".join(part.get("text", "") for part in item.get("content") or [])
            item = {**item, "encrypted_content": sealer.seal(REASONING_KIND, {"text": text})}
        out.append(item)
    return out
