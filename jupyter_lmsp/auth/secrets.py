"""Tokens and codes: how they are made, shown and stored.

Access tokens and device codes carry 256 bits from `secrets`; only their sha256 is stored, so
the database never holds a usable credential. (A plain hash suffices for 256-bit random
secrets: there is nothing to brute-force.) User codes are short and typable, not secret.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

TOKEN_PREFIX = "lmsp_"
DEVICE_CODE_PREFIX = "lmspdc_"
# No vowels (no words), no look-alikes: 20 letters, 8 of them ≈ 34.6 bits.
USER_CODE_ALPHABET = "BCDFGHJKLMNPQRSTVWXZ"


def new_access_token() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def new_device_code() -> str:
    return DEVICE_CODE_PREFIX + secrets.token_urlsafe(32)


def new_user_code() -> str:
    letters = "".join(secrets.choice(USER_CODE_ALPHABET) for _ in range(8))
    return f"{letters[:4]}-{letters[4:]}"


def normalize_user_code(code: str) -> str:
    letters = "".join(ch for ch in code.upper() if ch.isalnum())
    return f"{letters[:4]}-{letters[4:]}" if len(letters) == 8 else code.upper()


def secret_hash(value: str) -> str:
    return "sha256:" + hashlib.sha256(value.encode()).hexdigest()


def matches(value: str, stored_hash: str) -> bool:
    """Whether `value` hashes to `stored_hash`, compared in constant time."""
    return hmac.compare_digest(secret_hash(value), stored_hash)
