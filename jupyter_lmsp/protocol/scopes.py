"""Scopes (LMSP B3): what a paired client's token allows. The Jupyter user holds them all."""

from __future__ import annotations

from typing import Literal, get_args

Scope = Literal[
    "models:read",
    "models:write",
    "responses:read",
    "responses:write",
    "tasks:read",
    "tasks:write",
    "conversations:read",
    "conversations:write",
    "clients:admin",
    "metrics:read",
]

SCOPES: tuple[Scope, ...] = get_args(Scope)
