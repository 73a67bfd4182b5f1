"""Making the `Caller` of a Jupyter-authenticated request (LMSP B12); a paired client's is
`services.pairing.authenticate`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..auth.identity import jupyter_scopes, owner_for
from ..auth.scopes import SCOPES, Caller
from ..store import clients
from ..store.database import Database


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
