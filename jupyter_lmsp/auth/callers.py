"""Making the `Caller` of a request: a Jupyter user (LMSP B12) or a paired client (B3)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from ..store import clients
from ..store.database import Database
from ..store.tables import Client
from .identity import jupyter_scopes, owner_for, server_owner, server_user
from .scopes import SCOPES, Caller


def _paired(db: Database, owner: str) -> Callable[[], frozenset[str]]:
    return lambda: clients.clients_paired_by(db, owner)


async def jupyter_caller(handler: Any, db: Database, owner_from: str = "auto") -> Caller:
    """The caller Jupyter Server authenticated for `handler`'s request: its owner id from the
    identity, its scopes from Jupyter's authorizer."""
    user = handler.current_user
    owner = owner_for(user, handler.identity_provider, owner_from)
    scopes = await jupyter_scopes(handler, user, SCOPES)
    name = getattr(user, "display_name", None) or getattr(user, "name", None) or owner
    return Caller(owner, scopes, name, paired_clients=_paired(db, owner))


def client_caller(client: Client) -> Caller:
    return Caller(client.id, frozenset(json.loads(client.scopes)), client.name)


def server_caller(db: Database) -> Caller:
    """The user the server runs for, with every scope: who `jupyter lmsp …` acts as."""
    owner = server_owner()
    return Caller(owner, frozenset(SCOPES), server_user(), paired_clients=_paired(db, owner))
