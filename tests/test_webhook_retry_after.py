"""Webhooks honour `Retry-After` (issue 38): a real `WebhookDeliverer` on a SQLite store sends
to real receivers on loopback (tests/webhookreceiver.py).

- A 429 or 503 with `Retry-After` in seconds or as an HTTP date makes the delivery due no
  earlier than asked (the stored `next_attempt_at` is the attempt's time plus the wait), and
  a receiver that asks for 2 s is not called again sooner (its second receipt is at least 2 s
  after the first), then gets the event.
- A longer ask than `backoff_max` is cut to it; a malformed header, or one on another status
  (500, asking 100000 s), leaves the exponential backoff alone in charge: they are delivered
  at their second attempt.
"""

from __future__ import annotations

import json
import time
from email.utils import formatdate

import pytest
from storehelpers import open_db, running_response, usage
from webhookreceiver import Receiver

from jupyter_lmsp.services.webhook_delivery import (
    DeliverySettings,
    WebhookDeliverer,
    new_secret,
    retry_after_seconds,
)
from jupyter_lmsp.store import rules, runners
from jupyter_lmsp.store import webhooks as outbox
from jupyter_lmsp.store.database import Database
from jupyter_lmsp.store.tables import WebhookEndpoint

pytestmark = pytest.mark.timeout(120)

OWNER = "jupyter:alice"
BACKOFF = 0.05
BACKOFF_MAX = 600.0


def endpoint_for(db: Database, receiver: Receiver, n: int) -> str:
    now = time.time()
    secret = new_secret()
    receiver.secret = secret
    e = WebhookEndpoint(
        id=f"whep_retry_after_{n}",
        owner=OWNER,
        url=receiver.url,
        events=json.dumps(["response.completed"]),
        secret=secret,
        enabled=True,
        created_at=now,
        updated_at=now,
    )
    outbox.create_endpoint(db, e)
    return e.id


def complete_one(db: Database) -> None:
    """A background response of OWNER that completes: one delivery to each of its endpoints."""
    task_id, _ = running_response(db, OWNER)
    rules.finish(db, task_id, rules.Outcome("completed", usage=usage()))


def attempted(db: Database, endpoint_id: str, attempts: int) -> outbox.WebhookDelivery:
    """The endpoint's one delivery, once it has had `attempts` attempts."""
    while True:
        (row,) = outbox.list_deliveries(db, OWNER, endpoint_id) or [None]
        assert row is not None
        if row.attempts >= attempts:
            return row
        time.sleep(0.02)


def test_retry_after_seconds_and_http_dates():
    now = 1_800_000_000.0
    assert retry_after_seconds("120", now) == 120.0
    assert retry_after_seconds(" 0 ", now) == 0.0
    assert retry_after_seconds("9" * 5000, now) == float("inf")  # then capped by backoff_max
    assert retry_after_seconds(formatdate(now + 90, usegmt=True), now) == 90.0
    assert retry_after_seconds(formatdate(now - 90, usegmt=True), now) == 0.0  # past: now
    for bad in (None, "", "-5", "1.5", "soon", "٣", "Wed, 99 Foo 2026 00:00:00 GMT"):
        assert retry_after_seconds(bad, now) is None, bad
    s = DeliverySettings(backoff_initial=5.0, backoff_max=60.0)
    assert s.backoff(1) == 5.0 and s.backoff(1, 30.0) == 30.0  # the longer of the two
    assert s.backoff(3, 1.0) == 20.0 and s.backoff(1, 10_000.0) == 60.0  # capped
    assert s.backoff(1, float("inf")) == 60.0


def test_receivers_are_not_called_again_before_their_retry_after(tmp_path):
    db = open_db(tmp_path)
    asks = {
        # receiver -> (status, Retry-After) of its first answer; the later ones are 200
        "seconds": (429, lambda: "30"),
        "date": (503, lambda: formatdate(time.time() + 120, usegmt=True)),
        "too_long": (429, lambda: "100000"),
        "malformed": (503, lambda: "in a while"),
        "other_status": (500, lambda: "100000"),
        "short": (429, lambda: "2"),
    }
    receivers: dict[str, Receiver] = {}
    endpoints: dict[str, str] = {}
    for n, (name, (status, header)) in enumerate(asks.items()):

        def answer(_id: str, k: int, status: int = status) -> int:
            return status if k == 1 else 200

        def headers(_id: str, k: int, header=header) -> dict[str, str]:  # type: ignore[no-untyped-def]
            return {"retry-after": header()} if k == 1 else {}

        receivers[name] = Receiver(answer)
        receivers[name].answer_headers = headers
        endpoints[name] = endpoint_for(db, receivers[name], n)
    complete_one(db)
    runner = runners.register(db, lease_seconds=60).id
    settings = DeliverySettings(
        max_attempts=5, backoff_initial=BACKOFF, backoff_max=BACKOFF_MAX, poll_interval=0.05
    )
    deliverer = WebhookDeliverer(db, lambda: runner, settings)
    deliverer.start()
    try:
        waits = {}
        for name in ("seconds", "date", "too_long"):
            row = attempted(db, endpoints[name], 1)
            assert row.state == "pending" and row.last_status == asks[name][0], (name, row)
            waits[name] = row.next_attempt_at - row.updated_at
        assert waits["seconds"] == 30.0
        assert 118.0 <= waits["date"] <= 121.0  # an HTTP date has whole seconds
        assert waits["too_long"] == BACKOFF_MAX
        # The backoff-only ones are sent again after the backoff (were their 100000 s honoured,
        # the test's timeout would end this wait) and delivered at their second attempt...
        for name in ("malformed", "other_status"):
            assert receivers[name].wait_accepted(1, timeout=60), name
            row = attempted(db, endpoints[name], 2)
            assert row.state == "delivered" and row.attempts == 2, (name, row)
        # ...and the receiver that asked for 2 s gets its second call no sooner.
        assert receivers["short"].wait_accepted(1, timeout=60)
        (times,) = receivers["short"].received_at.values()
        assert len(times) == 2 and times[1] - times[0] >= 2.0, times
        # The ones that asked for 30 s and more are still waiting, called once.
        for name in ("seconds", "date", "too_long"):
            assert [len(t) for t in receivers[name].received_at.values()] == [1], name
        assert all(not r.bad for r in receivers.values())
    finally:
        deliverer.stop()
        for r in receivers.values():
            r.close()
        db.dispose()
