"""Revoking a paired client (LMSP B3): its token stops working, its tasks stop, its streams end.

`store.rules.revoke_client` revokes the client (and the clients it approved) and cancels their
unfinished tasks in one transaction, each with the error `client_revoked`. Here the committed
events are published, the generations and registrations still running are stopped, and every
event stream the revoked clients hold open is closed at once (a stream of a task that is still
`cancelling` would otherwise stay open until the task ends).
"""

from __future__ import annotations

from typing import Any

from ..auth.scopes import Caller
from ..protocol.errors import not_found
from ..protocol.objects import client_object
from ..store import clients, rules
from . import pairing
from .context import ServiceContext


async def revoke_client(
    ctx: ServiceContext, client_id: str, caller: Caller | None = None
) -> dict[str, Any]:
    """Revoke a client `caller` manages (LMSP B12: the Jupyter user who paired it); anyone
    else's is absent (404), as a client that does not exist."""
    if caller is not None:
        found = await ctx.offload(clients.get_client, ctx.db, client_id)
        if found is None or not pairing.manages(caller, found):
            raise not_found("client", client_id)
    revocation = await ctx.offload(rules.revoke_client, ctx.db, client_id)
    if revocation is None:
        raise not_found("client", client_id)
    for committed in revocation.committed:
        ctx.runner.cancelled(committed)
    for client in revocation.clients:
        ctx.bus.close_caller(client.id)
    return client_object(revocation.clients[0])
