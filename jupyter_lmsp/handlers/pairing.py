"""`/lmsp/v1/pairings` and `/lmsp/v1/clients`: the pairing flow and the owner's client list.

Starting a pairing and polling for its token need no credentials (the client has none yet);
starting is rate-limited per remote address (before its body, at most 4 KiB, is read), polling
per pairing. Neither takes an
`Idempotency-Key`: nothing is keyed before the caller is known, and starting's result holds the
device code, a secret, which must never be stored to be replayed. Deciding and managing clients
need `clients:admin`.
"""

from __future__ import annotations

from ..protocol.operations import Reply
from ..protocol.pairing import (
    Client,
    ClientList,
    Pairing,
    PairingDecisionRequest,
    PairingList,
    PairingStarted,
    PairingToken,
    PairingTokenRequest,
    StartPairingRequest,
)
from ..services import metrics, pairing, revocation
from .base import LMSPHandler, operation


class PairingsHandler(LMSPHandler):
    # Unauthenticated: a start is a client name and a few scopes (issue 43: a 1 MiB body
    # parsed before the rate limit stalled the loop for seconds).
    body_limit = 4096

    def admit_early(self) -> None:
        if self.request.method == "POST":
            # Before the body is read or parsed: a flood costs a token-bucket check each.
            self.ctx.pairing_limiter.check(self.remote_address)

    @operation(
        "startPairing",
        "Start pairing a client (no credentials): the device flow of RFC 8628",
        "pairing",
        access="public",
        replies={201: Reply("The pairing, with the device and user codes.", PairingStarted)},
        errors=(429,),
    )
    async def post(self, body: StartPairingRequest) -> None:
        started = await self.call(
            pairing.start,
            self.ctx.db,
            body,
            self.ctx.pairing_ttl,
            started_by=self.lmsp_caller,
            max_pending=self.ctx.max_pending_pairings,
        )
        metrics.pairing_started()
        self.write_json(started, 201)

    @operation(
        "listPairings",
        "Pairings waiting for the owner's decision",
        "pairing",
        access="clients:admin",
        replies={200: Reply("The pairings.", PairingList)},
    )
    async def get(self) -> None:
        self.write_json(await self.call(pairing.pending, self.ctx.db))


def _decision(approve: bool) -> type[LMSPHandler]:
    verb = "approve" if approve else "deny"

    class PairingDecisionHandler(LMSPHandler):
        @operation(
            f"{verb}Pairing",
            f"{verb.capitalize()} a pairing (by its id or its user code)",
            "pairing",
            access="clients:admin",
            replies={200: Reply("The pairing as decided.", Pairing)},
            errors=(400, 404),
            idempotent=True,
            description="A paired client grants only scopes it holds, never to a pairing it "
            "started.",
        )
        async def post(self, pairing_id: str, body: PairingDecisionRequest | None) -> None:
            scopes = body.scopes if approve and body is not None else None
            decided = await self.call(
                pairing.decide, self.ctx.db, pairing_id, approve, scopes, self.caller
            )
            metrics.pairing_decided(approve)
            self.write_json(decided)

    PairingDecisionHandler.__name__ = f"Pairing{verb.capitalize()}Handler"
    return PairingDecisionHandler


PairingApproveHandler = _decision(approve=True)
PairingDenyHandler = _decision(approve=False)


class PairingTokenHandler(LMSPHandler):
    @operation(
        "pollPairingToken",
        "Poll for the access token (no credentials)",
        "pairing",
        access="public",
        replies={200: Reply("The access token, issued once.", PairingToken)},
        errors=(404, 429),
    )
    async def post(self, pairing_id: str, body: PairingTokenRequest) -> None:
        self.write_json(
            await self.call(
                pairing.poll,
                self.ctx.db,
                pairing_id,
                body,
                self.ctx.poll_limiter,
                self.remote_address,
            )
        )


class ClientsHandler(LMSPHandler):
    @operation(
        "listClients",
        "Paired clients",
        "pairing",
        access="clients:admin",
        replies={200: Reply("The clients.", ClientList)},
    )
    async def get(self) -> None:
        self.write_json(await self.call(pairing.list_clients, self.ctx.db, self.caller))


class ClientHandler(LMSPHandler):
    @operation(
        "revokeClient",
        "Revoke a paired client's token",
        "pairing",
        access="clients:admin",
        replies={200: Reply("The client, revoked.", Client)},
        errors=(404,),
    )
    async def delete(self, client_id: str) -> None:
        self.write_json(await revocation.revoke_client(self.ctx, client_id, self.caller))
