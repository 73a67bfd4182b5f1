"""The program's side of pairing (LMSP B3, shaped like the OAuth device flow, RFC 8628).

A separate program that has no credentials asks for a pairing, shows the short `user_code` to
the person at the keyboard, and polls until the owner approves it (in JupyterLab, with
`jupyter lmsp pair approve CODE`, or `Client.approve_pairing`). It then holds an access token
that it sends as `Authorization: Bearer …` — to `Client.paired(url, token)` or as the
`api_key` of an `openai.OpenAI` client.

    request = request_pairing(url, "my script", ["responses:write", "responses:read"])
    print("Approve code", request.user_code)
    token = wait_for_token(url, request)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from .discovery import normalize_url
from .errors import APIError, LMSPClientError


@dataclass
class PairingRequest:
    id: str
    device_code: str = field(repr=False)
    user_code: str
    expires_at: int
    interval: int
    scopes: list[str]


@dataclass
class PairingToken:
    client_id: str
    access_token: str = field(repr=False)
    scopes: list[str]


class PairingDeniedError(LMSPClientError):
    """The owner denied the pairing, or it expired before a decision."""

    def __init__(self, code: str, message: str) -> None:
        self.code = code
        super().__init__(f"{code}: {message}")


def _post(url: str, path: str, body: dict[str, Any], timeout: float) -> httpx.Response:
    return httpx.post(normalize_url(url) + "lmsp/v1" + path, json=body, timeout=timeout)


def request_pairing(
    url: str, client_name: str, scopes: list[str], *, timeout: float = 30.0
) -> PairingRequest:
    """`POST /pairings` (no credentials): a pairing waiting for the owner's decision."""
    r = _post(url, "/pairings", {"client_name": client_name, "scopes": scopes}, timeout)
    if r.status_code >= 400:
        raise APIError(r.status_code, r.json(), dict(r.headers))
    data = r.json()
    return PairingRequest(
        id=data["id"],
        device_code=data["device_code"],
        user_code=data["user_code"],
        expires_at=int(data["expires_at"]),
        interval=int(data.get("interval", 5)),
        scopes=list(data.get("scopes") or scopes),
    )


def poll_token(url: str, request: PairingRequest, *, timeout: float = 30.0) -> PairingToken | None:
    """One poll: the token once approved, None while pending; raises if denied or expired."""
    r = _post(url, f"/pairings/{request.id}/token", {"device_code": request.device_code}, timeout)
    if r.status_code < 400:
        data = r.json()
        return PairingToken(data["client_id"], data["access_token"], list(data["scopes"]))
    body = r.json()
    code = (body.get("error") or {}).get("code", "")
    if code == "authorization_pending":
        return None
    if code == "slow_down":
        request.interval += 5  # RFC 8628 3.5: add 5 seconds to the interval
        return None
    if code in ("access_denied", "expired_token"):
        raise PairingDeniedError(code, (body.get("error") or {}).get("message", ""))
    raise APIError(r.status_code, body, dict(r.headers))


def wait_for_token(
    url: str, request: PairingRequest, *, timeout: float | None = None
) -> PairingToken:
    """Poll every `interval` seconds until the owner decides (or `timeout` passes)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        token = poll_token(url, request)
        if token is not None:
            return token
        if deadline is not None and time.monotonic() + request.interval > deadline:
            raise TimeoutError(f"pairing {request.id} was not approved in time")
        time.sleep(request.interval)
