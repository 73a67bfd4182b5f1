"""Sealed items: what a stateless client carries between turns for the service (a compaction's
summary, `encrypted_content`), opaque to it and worthless to anyone else.

A sealed item is `lmsp1.` and the URL-safe base64 of a 96-bit nonce and the AES-256-GCM
ciphertext of its JSON, with its kind as associated data: it opens only with the key this
service keeps (`store.queries.sealing_key`, shared by every server on the database), only as
the kind it was sealed as, and only unaltered. Anything else, a foreign blob, a tampered one,
one sealed as another kind, is refused as a 400 naming the field it came in, never a 500.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from ..protocol.errors import LMSPError

PREFIX = "lmsp1."
_NONCE = 12


class Sealer:
    def __init__(self, key: bytes) -> None:
        self._aead = AESGCM(key)

    def seal(self, kind: str, content: dict[str, Any]) -> str:
        nonce = os.urandom(_NONCE)
        sealed = self._aead.encrypt(nonce, json.dumps(content).encode(), kind.encode())
        return PREFIX + base64.urlsafe_b64encode(nonce + sealed).decode("ascii")

    def unseal(self, kind: str, blob: str, param: str) -> dict[str, Any]:
        """What `seal(kind, ...)` sealed into `blob`; a 400 `invalid_encrypted_content` naming
        `param` for anything this service did not seal as that kind."""
        try:
            if not blob.startswith(PREFIX):
                raise ValueError("not a sealed item of this service")
            raw = base64.urlsafe_b64decode(blob[len(PREFIX) :].encode("ascii"))
            if len(raw) <= _NONCE:
                raise ValueError("too short")
            opened = self._aead.decrypt(raw[:_NONCE], raw[_NONCE:], kind.encode())
            content = json.loads(opened)
        except (ValueError, UnicodeEncodeError, binascii.Error, InvalidTag) as e:
            raise LMSPError(
                400,
                "invalid_encrypted_content",
                f"'{param}' could not be opened: it was not sealed by this service as a {kind} "
                "item, or it was altered.",
                param=param,
            ) from e
        if not isinstance(content, dict):
            raise LMSPError(
                400, "invalid_encrypted_content", f"'{param}' is malformed.", param=param
            )
        return content
