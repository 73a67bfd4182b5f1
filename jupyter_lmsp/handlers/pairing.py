"""`/lmsp/v1/pairings` and `/lmsp/v1/clients`: the pairing flow and the owner's client list.

Starting a pairing and polling for its token need no credentials (the client has none yet);
both are rate-limited per remote address. Deciding and managing clients need `clients:admin`.
"""

from __future__ import annotations

from ..auth import pairing
from .base import LMSPHandler, allow_unauthenticated, idempotent, public, requires


class PairingsHandler(LMSPHandler):
    @allow_unauthenticated
    @public
    @idempotent
    def post(self) -> None:
        self.ctx.pairing_limiter.check(self.remote_address)
        self.write_json(pairing.start(self.ctx.db, self.json_body(), self.ctx.pairing_ttl), 201)

    @allow_unauthenticated
    @requires("clients:admin")
    def get(self) -> None:
        self.write_json(pairing.pending(self.ctx.db))


class PairingDecisionHandler(LMSPHandler):
    @allow_unauthenticated
    @requires("clients:admin")
    @idempotent
    def post(self, pairing_id: str, decision: str) -> None:
        body = self.json_body() if self.request.body else {}
        approve = decision == "approve"
        self.write_json(
            pairing.decide(
                self.ctx.db, pairing_id, approve, body.get("scopes"), decided_by=self.caller.id
            )
        )


class PairingTokenHandler(LMSPHandler):
    @allow_unauthenticated
    @public
    def post(self, pairing_id: str) -> None:
        self.ctx.pairing_limiter.check(self.remote_address)
        self.write_json(pairing.poll(self.ctx.db, pairing_id, self.json_body()))


class ClientsHandler(LMSPHandler):
    @allow_unauthenticated
    @requires("clients:admin")
    def get(self) -> None:
        self.write_json(pairing.list_clients(self.ctx.db, self.caller))


class ClientHandler(LMSPHandler):
    @allow_unauthenticated
    @requires("clients:admin")
    def delete(self, client_id: str) -> None:
        self.write_json(pairing.revoke(self.ctx.db, client_id, self.caller))
