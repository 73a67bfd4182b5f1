"""`/lmsp/v1/pairings` and `/lmsp/v1/clients`: the pairing flow and the owner's client list.

Starting a pairing and polling for its token need no credentials (the client has none yet);
starting is rate-limited per remote address, polling per pairing. Deciding and managing clients
need `clients:admin`. Starting takes no `Idempotency-Key`: its result holds the device code, a
secret, which must never be stored to be replayed.
"""

from __future__ import annotations

from ..auth import pairing
from ..protocol.errors import invalid
from ..services import idempotency, revocation
from .base import LMSPHandler, allow_unauthenticated, idempotent, public, requires


class PairingsHandler(LMSPHandler):
    @allow_unauthenticated
    @public
    def post(self) -> None:
        if self.request.headers.get(idempotency.HEADER) is not None:
            raise invalid(
                "Starting a pairing takes no 'Idempotency-Key' (its result holds a secret that "
                "is never stored); start again instead, the unused request expires.",
                param=idempotency.HEADER,
                code="idempotency_key_not_supported",
            )
        self.ctx.pairing_limiter.check(self.remote_address)
        self.write_json(
            pairing.start(
                self.ctx.db,
                self.json_body(),
                self.ctx.pairing_ttl,
                started_by=self.lmsp_caller,
                max_pending=self.ctx.max_pending_pairings,
            ),
            201,
        )

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
            pairing.decide(self.ctx.db, pairing_id, approve, body.get("scopes"), self.caller)
        )


class PairingTokenHandler(LMSPHandler):
    @allow_unauthenticated
    @public
    def post(self, pairing_id: str) -> None:
        self.write_json(
            pairing.poll(
                self.ctx.db,
                pairing_id,
                self.json_body(),
                self.ctx.poll_limiter,
                self.remote_address,
            )
        )


class ClientsHandler(LMSPHandler):
    @allow_unauthenticated
    @requires("clients:admin")
    def get(self) -> None:
        self.write_json(pairing.list_clients(self.ctx.db))


class ClientHandler(LMSPHandler):
    @allow_unauthenticated
    @requires("clients:admin")
    def delete(self, client_id: str) -> None:
        self.write_json(revocation.revoke_client(self.ctx, client_id))
