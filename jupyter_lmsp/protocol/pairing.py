"""Pairing and paired clients on the wire (LMSP B3, the device flow of RFC 8628)."""

from __future__ import annotations

import unicodedata
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field

from .fields import Body, WireObject, refuse
from .scopes import SCOPES, Scope


def _known_scopes(value: Any) -> Any:
    # One error for the whole list, naming the unknown scopes (not one per entry).
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise refuse("invalid_value", "'{param}' must be a list of scope names.")
    unknown = [s for s in value if s not in SCOPES]
    if unknown:
        raise refuse(
            "invalid_value",
            f"Unknown scope(s): {', '.join(unknown)}. Known: {', '.join(SCOPES)}.",
        )
    return sorted(set(value), key=SCOPES.index)


Scopes = Annotated[list[Scope], BeforeValidator(_known_scopes)]


def _client_name(value: Any) -> Any:
    if not isinstance(value, str) or not 1 <= len(value.strip()) <= 100:
        raise refuse("invalid_value", "'{param}' must be a string of 1 to 100 characters.")
    if any(_unshowable(c) for c in value):
        # The owner reads the name on the approval card: a NUL, a newline or a bidi override
        # (U+202E) would make one client's request look like another's (issue 43).
        raise refuse(
            "invalid_value",
            "'{param}' must not contain control, format or bidirectional-override characters.",
        )
    return value.strip()


def _unshowable(char: str) -> bool:
    """Control characters (Cc), format characters (Cf: the bidi embeddings, overrides and
    isolates, zero-width joiners), and line or paragraph separators."""
    return unicodedata.category(char) in ("Cc", "Cf", "Zl", "Zp")


class StartPairingRequest(Body):
    client_name: Annotated[
        str,
        BeforeValidator(_client_name),
        Field(
            min_length=1,
            max_length=100,
            pattern="\\S",
            description="Shown to the owner when they approve or deny the pairing.",
        ),
    ]
    scopes: Annotated[Scopes, Field(min_length=1, description="The scopes the client asks for.")]


class PairingDecisionRequest(Body):
    scopes: Scopes | None = Field(
        None, description="Approve only these (a subset of the requested scopes)."
    )


class PairingTokenRequest(Body):
    device_code: Annotated[str, Field(min_length=1)]


class PairingStarted(WireObject):
    """RFC 8628's device authorization response: the client keeps `device_code` secret and
    shows `user_code` to the owner."""

    id: str
    object: Literal["pairing"] = "pairing"
    device_code: str
    user_code: str = Field(examples=["WDJB-MJHT"])
    expires_at: int
    interval: Annotated[int, Field(ge=1, description="Seconds between polls.")]
    scopes: list[Scope]


class Pairing(WireObject):
    """A pairing as the owner sees it (never its device code)."""

    id: str
    object: Literal["pairing"] = "pairing"
    client_name: str
    requested_scopes: list[Scope]
    granted_scopes: list[Scope] | None
    user_code: str
    status: str = Field(examples=["pending", "approved", "denied", "claimed"])
    client_id: str | None
    created_at: int
    expires_at: int


class PairingList(WireObject):
    object: Literal["list"] = "list"
    data: list[Pairing]


class PairingToken(WireObject):
    """Issued exactly once, after the owner approved the pairing."""

    object: Literal["pairing.token"] = "pairing.token"
    client_id: str
    access_token: str
    token_type: Literal["Bearer"] = "Bearer"
    scopes: list[Scope]


class Client(WireObject):
    """A paired client (never its token)."""

    id: str
    object: Literal["client"] = "client"
    name: str
    scopes: list[Scope]
    created_at: int
    last_used_at: int | None
    revoked_at: int | None


class ClientList(WireObject):
    object: Literal["list"] = "list"
    data: list[Client]
