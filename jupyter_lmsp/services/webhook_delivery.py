"""Sending the webhook outbox (issue 38), off the IOLoop: a dispatcher thread and a pool of
sender threads.

The dispatcher (`lmsp-webhooks`) claims due deliveries (`store.webhooks.claim_due`, a lease
in this server's runner's name) as sender threads (`lmsp-webhook-send`) free up, at most
`per_endpoint` at once to any one endpoint, so a slow or dead receiver holds up only its own
deliveries; with nothing to send it waits until the next delivery is due, at most
`poll_interval` (deliveries other servers enqueue, or a redelivery, are seen then; `wake`
looks at once). A sender POSTs the stored payload, signed as Standard Webhooks specifies,
with one timeout for connecting and each read, never following a redirect, and records the
outcome (`record_attempt`): a 2xx is delivered; anything else is due again after an
exponential backoff, or dead after `max_attempts`. A receiver answering 429 or 503 with a
`Retry-After` (seconds, or an HTTP date) is not called again before the time it asks, unless it
asks for more than `backoff_max`: the wait is then `backoff_max` (a receiver cannot park a
delivery for days; it is refused again and counts an attempt).

At least once: a row is marked delivered only after its receiver answered, so a server killed
in between sends it again after its restart (or another server does, once the dead server's
runner row is gone), with the same `webhook-id` and body; the `webhook-timestamp` and
signature are those of each attempt.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import math
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import TYPE_CHECKING

from ..store import webhooks as outbox
from ..store.database import Database

if TYPE_CHECKING:
    import httpx

log = logging.getLogger(__name__)

SECRET_PREFIX = "whsec_"


def new_secret() -> str:
    """A Standard Webhooks secret: `whsec_` and 32 random bytes in base64."""
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(32)).decode()


def sign(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    """The `webhook-signature` header: `v1,` and the base64 HMAC-SHA256, keyed with the
    secret's bytes, of `{webhook-id}.{webhook-timestamp}.{body}`."""
    key = base64.b64decode(secret.removeprefix(SECRET_PREFIX))
    signed = f"{msg_id}.{timestamp}.".encode() + body
    digest = hmac.new(key, signed, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


@dataclass(frozen=True)
class DeliverySettings:
    max_attempts: int = 10
    # Seconds before the second attempt; each later wait doubles, up to `backoff_max`.
    backoff_initial: float = 5.0
    backoff_max: float = 3600.0
    timeout: float = 10.0
    concurrency: int = 4
    per_endpoint: int = 2
    poll_interval: float = 1.0

    @property
    def lease_seconds(self) -> float:
        # Longer than any one attempt can take (connect, send, the answer's head).
        return 3 * self.timeout + 10.0

    def backoff(self, attempts: int, retry_after: float | None = None) -> float:
        """The wait after the `attempts`-th failed attempt: the exponential backoff, or the
        receiver's `Retry-After` (in seconds from now) if that is longer, at most
        `backoff_max` either way."""
        wait = self.backoff_initial * 2 ** max(0, attempts - 1)
        if retry_after is not None:
            wait = max(wait, retry_after)
        return float(min(self.backoff_max, wait))


# The statuses whose Retry-After is honoured (RFC 9110 15.5.20 / 15.6.4; RFC 6585 4).
RETRY_AFTER_STATUSES = frozenset({429, 503})


def retry_after_seconds(value: str | None, now: float) -> float | None:
    """A `Retry-After` header's wait in seconds from `now`: a non-negative integer of seconds,
    or an HTTP date (a date in the past is 0). None when absent or not either form (the
    backoff alone decides then)."""
    if value is None:
        return None
    value = value.strip()
    if value.isascii() and value.isdigit():
        # More digits than any real wait (and than a float or `int()` takes): the longest.
        return float(int(value)) if len(value) <= 15 else math.inf
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when.tzinfo is None:  # RFC 9110's IMF-fixdate is GMT; an obsolete form may lack a zone
        return None
    return max(0.0, when.timestamp() - now)


class WebhookDeliverer:
    """The dispatcher and its senders (see the module docstring). `claimer` names the runner
    whose lease the claims are taken under (None: claim nothing for now)."""

    def __init__(
        self,
        db: Database,
        claimer: Callable[[], str | None],
        settings: DeliverySettings,
        user_agent: str = "jupyter-lmsp",
    ) -> None:
        self.db = db
        self.claimer = claimer
        self.settings = settings
        self.user_agent = user_agent
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._in_flight: dict[str, int] = {}  # endpoint id -> deliveries being sent
        self._thread: threading.Thread | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._client: httpx.Client | None = None

    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        if self._thread is not None:
            return
        s = self.settings
        self._pool = ThreadPoolExecutor(s.concurrency, thread_name_prefix="lmsp-webhook-send")
        self._thread = threading.Thread(target=self._run, name="lmsp-webhooks", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        """Look for due deliveries now (a redelivery was asked for)."""
        self._wake.set()

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._pool is not None:
            # Sends under way end within their timeout; their rows stay claimed until then,
            # and are sent again if the outcome was not recorded.
            self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            client = self._client
        if client is not None:
            # Kept, closed: a send still under way fails as a send does, rather than make a
            # client that nothing would close.
            client.close()

    def _http(self) -> httpx.Client:
        """The senders' HTTP client, made at the first send: importing httpx and building its TLS
        context cost every server start ~70 ms of CPU, and most servers never send a webhook."""
        import httpx

        with self._lock:
            if self._client is None:
                s = self.settings
                self._client = httpx.Client(
                    timeout=httpx.Timeout(s.timeout),
                    follow_redirects=False,
                    # Only the owner's URL is called, never through a proxy of the environment.
                    trust_env=False,
                    limits=httpx.Limits(max_connections=s.concurrency, max_keepalive_connections=0),
                )
            return self._client

    # -- the dispatcher --------------------------------------------------------------------

    def _run(self) -> None:
        s = self.settings
        while not self._stopping.is_set():
            self._wake.clear()
            wait = s.poll_interval
            try:
                wait = self._dispatch()
            except Exception:  # the database may be briefly unavailable: try again later
                log.exception("LMSP webhooks: claiming deliveries failed")
            self._wake.wait(max(0.0, wait))

    def _dispatch(self) -> float:
        """Claim and hand out what is due; how long to wait before looking again."""
        s = self.settings
        claimer = self.claimer()
        with self._lock:
            free = s.concurrency - sum(self._in_flight.values())
            in_flight = dict(self._in_flight)
        if claimer is None:
            return s.poll_interval
        if free <= 0:
            return s.poll_interval  # a sender that finishes wakes the dispatcher
        now = time.time()
        claimed = outbox.claim_due(
            self.db, claimer, free, s.lease_seconds, now, in_flight, s.per_endpoint
        )
        for due in claimed:
            self._start_send(claimer, due)
        if claimed:
            return 0.0 if len(claimed) == free else s.poll_interval
        due_at = outbox.next_due(self.db)
        if due_at is None:
            return s.poll_interval
        return min(s.poll_interval, max(0.0, due_at - time.time()))

    def _start_send(self, claimer: str, due: outbox.Due) -> None:
        with self._lock:
            endpoint = due.delivery.endpoint_id
            self._in_flight[endpoint] = self._in_flight.get(endpoint, 0) + 1
        assert self._pool is not None
        try:
            self._pool.submit(self._send, claimer, due)
        except RuntimeError:  # stopping: the claim runs out and another attempt comes later
            self._done(endpoint)

    def _done(self, endpoint: str) -> None:
        with self._lock:
            left = self._in_flight.get(endpoint, 1) - 1
            if left > 0:
                self._in_flight[endpoint] = left
            else:
                self._in_flight.pop(endpoint, None)
        self._wake.set()

    # -- a sender --------------------------------------------------------------------------

    def _send(self, claimer: str, due: outbox.Due) -> None:
        delivery = due.delivery
        try:
            status, error, retry_after = self.post(due)
            delivered = status is not None and 200 <= status < 300
            now = time.time()
            wait = self.settings.backoff(delivery.attempts + 1, retry_after)
            outbox.record_attempt(
                self.db,
                delivery.id,
                claimer,
                delivered=delivered,
                status=status,
                error=error,
                retry_at=now + wait,
                max_attempts=self.settings.max_attempts,
                now=now,
            )
        except Exception:
            log.exception("LMSP webhooks: delivery %s failed unexpectedly", delivery.id)
        finally:
            self._done(delivery.endpoint_id)

    def post(self, due: outbox.Due) -> tuple[int | None, str | None, float | None]:
        """One attempt: the HTTP status (None if there was no answer), what went wrong, and
        the seconds a 429 or 503 asked to wait (its `Retry-After`; None if it did not)."""
        import httpx

        client = self._http()
        delivery = due.delivery
        body = delivery.payload.encode()
        timestamp = int(time.time())
        headers = {
            "content-type": "application/json",
            "user-agent": self.user_agent,
            "webhook-id": delivery.event_id,
            "webhook-timestamp": str(timestamp),
            "webhook-signature": sign(due.secret, delivery.event_id, timestamp, body),
        }
        try:
            # The answer's head decides; its body is never read.
            with client.stream("POST", due.url, content=body, headers=headers) as answer:
                status = answer.status_code
                retry_after = None
                if status in RETRY_AFTER_STATUSES:
                    retry_after = retry_after_seconds(
                        answer.headers.get("retry-after"), time.time()
                    )
        except httpx.HTTPError as e:
            return None, f"{type(e).__name__}: {e}"[:500], None
        return status, None if 200 <= status < 300 else f"HTTP {status}", retry_after
