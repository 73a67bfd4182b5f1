"""Revoking a paired client (LMSP B3): its token stops working, its tasks stop, its streams end.

`store.rules.revoke_client` revokes the client (and the clients it approved) and cancels their
unfinished tasks in one transaction, each with the error `client_revoked`. Here the committed
events are published, the generations and registrations still running are stopped, and every
event stream the revoked clients hold open is closed at once (a stream of a task that is still
`cancelling` would otherwise stay open until the task ends).
"""

from __future__ import annotations

from typing import Any

from ..protocol.errors import not_found
from ..protocol.objects import client_object
from ..store import rules
from .context import ServiceContext


async def revoke_client(ctx: ServiceContext, client_id: str) -> dict[str, Any]:
    revocation = await ctx.offload(rules.revoke_client, ctx.db, client_id)
    if revocation is None:
        raise not_found("client", client_id)
    for committed in revocation.committed:
        ctx.runner.cancelled(committed)
    for client in revocation.clients:
        ctx.bus.close_caller(client.id)
    return client_object(revocation.clients[0])
