"""Callers: who is asking, and what they may do (LMSP B3)."""

from __future__ import annotations

from dataclasses import dataclass

from ..protocol.errors import insufficient_scope
from ..protocol.scopes import SCOPES, Scope

__all__ = ["OWNER", "OWNER_ID", "SCOPES", "Caller", "Scope"]

OWNER_ID = "owner"


@dataclass(frozen=True)
class Caller:
    """The Jupyter user (the owner, every scope, sees everything) or a paired client (its
    granted scopes, sees only what it created)."""

    id: str
    scopes: frozenset[str]
    name: str = ""

    @property
    def is_owner(self) -> bool:
        return self.id == OWNER_ID

    def require(self, scope: str) -> None:
        if scope not in self.scopes:
            raise insufficient_scope(scope)

    def can_see(self, owner: str) -> bool:
        return self.is_owner or owner == self.id

    @property
    def owner_filter(self) -> str | None:
        """The owner to filter listings by (None: all of them)."""
        return None if self.is_owner else self.id


OWNER = Caller(OWNER_ID, frozenset(SCOPES), "Jupyter user")
