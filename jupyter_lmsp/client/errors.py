"""Exceptions raised by the Python client.

`APIError` carries the LMSP error body (`{"error": {"type", "code", "message", "param"}}`, LMSP
B1) of a non-2xx answer. Network failures are left as `httpx.TransportError`: callers that
follow a task across a server restart (see `follow.EventFollower`) retry on those.
"""

from __future__ import annotations

from typing import Any


class LMSPClientError(Exception):
    """Base class of the client's own exceptions."""


class ServerNotFoundError(LMSPClientError):
    """No Jupyter server (or no LMSP service) could be found to connect to."""


class APIError(LMSPClientError):
    """The service answered with an error status."""

    def __init__(self, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
        self.status = status
        self.body = body
        self.headers = headers or {}
        error = body.get("error") if isinstance(body, dict) else None
        error = error if isinstance(error, dict) else {}
        self.type: str | None = error.get("type")
        self.code: str | None = error.get("code")
        self.param: str | None = error.get("param")
        self.message: str = error.get("message") or (
            body if isinstance(body, str) else f"HTTP {status}"
        )
        super().__init__(f"{status} {self.code or ''}: {self.message}".replace(" :", ":"))

    @property
    def retryable(self) -> bool:
        """Whether trying again later may succeed (the statuses the openai SDK retries)."""
        return self.status in (408, 409, 429) or self.status >= 500


class SequenceGapError(LMSPClientError):
    """An event arrived whose sequence number skips some: the text would be missing a piece."""

    def __init__(self, expected: int, got: int) -> None:
        self.expected = expected
        self.got = got
        super().__init__(f"expected event {expected}, got {got}")
