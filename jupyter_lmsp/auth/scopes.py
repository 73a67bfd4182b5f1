"""Callers: who is asking, and what they may do and see (LMSP B3, B12)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..protocol.errors import insufficient_scope
from ..protocol.scopes import SCOPES, Scope
from .identity import is_jupyter_owner, server_owner

__all__ = ["OWNER", "OWNER_ID", "SCOPES", "Caller", "Scope"]


@dataclass(frozen=True)
class Caller:
    """A Jupyter user (`jupyter:<name>`, the scopes Jupyter's authorizer grants it) or a
    paired client (`client_…`, its granted scopes).

    A paired client sees only what it created. A Jupyter user sees what it created and what
    the clients it paired created: `paired_clients` reads those (once, when first needed).
    """

    id: str
    scopes: frozenset[str]
    name: str = ""
    paired_clients: Callable[[], frozenset[str]] | None = field(default=None, compare=False)
    _seen: dict[str, frozenset[str]] = field(default_factory=dict, compare=False, repr=False)

    @property
    def is_jupyter_user(self) -> bool:
        return is_jupyter_owner(self.id)

    @property
    def is_owner(self) -> bool:
        """A Jupyter user (an owner of the service's host, as opposed to a paired client):
        host paths, no quotas, every scope its authorizer grants."""
        return self.is_jupyter_user

    def require(self, scope: str) -> None:
        if scope not in self.scopes:
            raise insufficient_scope(scope)

    @property
    def visible_owners(self) -> frozenset[str]:
        """The owners whose tasks and responses this caller sees."""
        if "owners" not in self._seen:
            paired = self.paired_clients() if self.paired_clients is not None else frozenset()
            self._seen["owners"] = frozenset({self.id}) | paired
        return self._seen["owners"]

    def can_see(self, owner: str) -> bool:
        return owner == self.id or owner in self.visible_owners

    @property
    def owner_filter(self) -> list[str]:
        """The owners to filter listings by."""
        return sorted(self.visible_owners)


# The user the server runs for, with every scope: who the command line acts as, and the
# default where a function serves the server's own user.
OWNER_ID = server_owner()
OWNER = Caller(OWNER_ID, frozenset(SCOPES), "Jupyter user")
