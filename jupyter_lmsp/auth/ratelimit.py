"""Token buckets for requests that carry no credentials (pairing, LMSP B3).

One `RateLimiter` per kind of request, each with its own buckets: starting a pairing is limited
per remote address, polling for a token per pairing (see `auth.pairing`), so a program that
spams one kind cannot lock another program out of the other (every local program is 127.0.0.1).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from ..protocol.errors import LMSPError


@dataclass
class _Bucket:
    tokens: float
    updated: float


class RateLimiter:
    def __init__(
        self,
        per_minute: float,
        burst: int,
        message: str = "Too many unauthenticated requests from this address; slow down.",
    ) -> None:
        self.rate = per_minute / 60.0
        self.burst = burst
        self.message = message
        self._buckets: dict[str, _Bucket] = {}

    def check(self, key: str, now: float | None = None) -> None:
        """Take one token for `key`, or raise 429 with `Retry-After`."""
        now = time.monotonic() if now is None else now
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = _Bucket(float(self.burst), now)
        bucket.tokens = min(self.burst, bucket.tokens + (now - bucket.updated) * self.rate)
        bucket.updated = now
        if bucket.tokens < 1:
            wait = math.ceil((1 - bucket.tokens) / self.rate)
            raise LMSPError(
                429,
                "rate_limit_exceeded",
                self.message,
                type="rate_limit_error",
                headers={"Retry-After": str(wait)},
            )
        bucket.tokens -= 1
        if len(self._buckets) > 10_000:  # forget idle addresses
            cutoff = now - self.burst / self.rate
            self._buckets = {k: b for k, b in self._buckets.items() if b.updated > cutoff}
