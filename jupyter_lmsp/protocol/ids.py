"""Identifiers: a prefix that says what the object is, then 128 random bits in hex."""

from __future__ import annotations

import secrets


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def message_item_id(response_id: str) -> str:
    """The id of a response's single output message, derived so every attempt reuses it."""
    return "msg_" + response_id.split("_", 1)[1]
