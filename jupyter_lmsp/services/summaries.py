"""Compaction summaries in a conversation: the sealed content of a `compaction` item opened into
the message the model reads in place of the turns it replaced (`services.compaction` writes
them).

The summary is a user message that says what it is, as coding agents insert their own
summaries: the model reads it as context handed to it, not as something it said.
"""

from __future__ import annotations

from typing import Any

from ..protocol.response_input import COMPACTION_KEY, COMPACTION_PARAM_KEY
from .sealing import Sealer

# What a compaction item is sealed as (the associated data: no other sealed kind opens as it).
KIND = "compaction"
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
    summary it seals; a 400 naming the item for one this service did not seal, or altered."""
    if not any(COMPACTION_KEY in m for m in messages):
        return messages
    assert sealer is not None, "the service context has no sealer"
    opened = []
    for message in messages:
        if COMPACTION_KEY in message:
            content = sealer.unseal(KIND, message[COMPACTION_KEY], message[COMPACTION_PARAM_KEY])
            message = summary_message(str(content.get("summary", "")))
        opened.append(message)
    return opened
