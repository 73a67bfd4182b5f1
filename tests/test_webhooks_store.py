"""The webhook outbox in the store (issue 38), on SQLite and PostgreSQL.

- A background response's terminal event writes its deliveries in the same transaction:
  to the endpoints of the owner's Jupyter user (its own tasks and its paired clients') that
  want the event's type; none for another user's, a disabled endpoint, a foreground response
  or a registration; a transaction that rolls back leaves none; the 11.3 table's `failed`
  writes them too. The payload is OpenAI's webhook event.
- Claims: two servers claiming at once get disjoint rows; at most `per_endpoint` to one
  endpoint; a claim whose lease ran out, or whose runner row was deleted (a dead server's
  recovery), is taken over.
- Attempts: a failure makes the row due again at the time asked; after `max_attempts` it is
  dead; redelivery makes it pending with the same event id and payload; a delivered row stays
  delivered; a failure recorded by a server that lost its claim changes nothing.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
from storehelpers import open_db, running_response, usage

from jupyter_lmsp.store import rules, runners
from jupyter_lmsp.store import webhooks as outbox
from jupyter_lmsp.store.database import Database
from jupyter_lmsp.store.tables import Client, WebhookEndpoint


@pytest.fixture
def db(db_url):  # type: ignore[no-untyped-def]
    database = open_db(db_url)
    yield database
    database.dispose()


ALICE, BOB = "jupyter:alice", "jupyter:bob"
ALL = ["response.cancelled", "response.completed", "response.failed", "response.incomplete"]


def endpoint(db: Database, owner: str, events: list[str], enabled: bool = True) -> str:
    now = time.time()
    e = WebhookEndpoint(
        id=f"whep_{owner.split(':')[-1]}_{len(events)}_{int(enabled)}_{time.monotonic_ns()}",
        owner=owner,
        url="http://127.0.0.1:9/hook",
        events=json.dumps(events),
        secret="whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
        enabled=enabled,
        created_at=now,
        updated_at=now,
    )
    outbox.create_endpoint(db, e)
    return e.id


def deliveries(db: Database, endpoint_id: str, owner: str = ALICE) -> list:
    found = outbox.list_deliveries(db, owner, endpoint_id)
    assert found is not None
    return found


def test_terminal_events_write_their_deliveries_in_the_same_transaction(db):
    done_only = endpoint(db, ALICE, ["response.completed"])
    every = endpoint(db, ALICE, ALL)
    off = endpoint(db, ALICE, ALL, enabled=False)
    bobs = endpoint(db, BOB, ALL)
    with db.writing() as conn:  # a client alice paired
        conn.execute(
            Client.__table__.insert(),  # type: ignore[attr-defined]
            {"id": "client_a", "name": "a", "token_hash": "h", "scopes": "[]"}
            | {"created_at": time.time(), "paired_by": ALICE},
        )

    tid, rid = running_response(db, ALICE)
    rules.finish(db, tid, rules.Outcome("completed", usage=usage()))
    tid2, rid2 = running_response(db, "client_a")
    rules.finish(db, tid2, rules.Outcome("failed", error={"code": "x", "message": "y"}))
    tid3, _ = running_response(db, ALICE, background=False)  # answered directly: no webhook
    rules.finish(db, tid3, rules.Outcome("completed", usage=usage()))
    # The 11.3 table's `failed` (a running task no live runner holds, policy fail) sends too.
    _, rid5 = running_response(db, ALICE)
    assert rules.recover_runner(db, None).transitions == {"running->failed": 1}
    # A rule whose transaction rolls back leaves no delivery.
    tid4, _ = running_response(db, ALICE)
    try:
        with db.writing() as conn:
            rules.finish(_Within(conn), tid4, rules.Outcome("completed", usage=usage()))  # type: ignore[arg-type]
            raise RuntimeError("rolled back")
    except RuntimeError:
        pass

    got = [(d.event_type, json.loads(d.payload)["data"]["id"]) for d in deliveries(db, every)]
    assert got == [
        ("response.completed", rid),
        ("response.failed", rid2),
        ("response.failed", rid5),
    ]
    assert [d.response_id for d in deliveries(db, done_only)] == [rid]
    assert deliveries(db, off) == [] and deliveries(db, bobs, BOB) == []
    # One event, one id: shared by every endpoint it goes to; OpenAI's event shape.
    (first,) = deliveries(db, done_only)
    assert first.event_id == deliveries(db, every)[0].event_id
    payload = json.loads(first.payload)
    assert payload == {
        "id": first.event_id,
        "object": "event",
        "type": "response.completed",
        "created_at": payload["created_at"],
        "data": {"id": rid},
    }
    assert first.event_id.startswith("evt_") and isinstance(payload["created_at"], int)
    assert outbox.counts(db) == {"pending": 4, "delivered": 0, "dead": 0}


class _Within:
    """A database whose `writing()` is an open transaction (so a rule runs inside it)."""

    def __init__(self, conn):  # type: ignore[no-untyped-def]
        self.conn = conn

    def writing(self):  # type: ignore[no-untyped-def]
        import contextlib

        return contextlib.nullcontext(self.conn)


def _pending(db: Database, n: int, endpoints: list[str]) -> None:
    for _ in range(n):
        tid, _ = running_response(db, ALICE)
        rules.finish(db, tid, rules.Outcome("completed", usage=usage()))
    counts = outbox.counts(db)
    assert counts["pending"] == n * len(endpoints), counts


def test_claims_are_disjoint_capped_per_endpoint_and_taken_over(db):
    a = endpoint(db, ALICE, ["response.completed"])
    b = endpoint(db, ALICE, ["response.completed", "response.failed"])
    _pending(db, 6, [a, b])
    one = runners.register(db, lease_seconds=60).id
    two = runners.register(db, lease_seconds=60).id
    now = time.time()

    results: dict[str, list[outbox.Due]] = {}

    def claim(who: str) -> None:
        results[who] = outbox.claim_due(db, who, 10, 30.0, now, per_endpoint=2)

    threads = [threading.Thread(target=claim, args=(w,)) for w in (one, two)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ids = {w: {d.delivery.id for d in found} for w, found in results.items()}
    assert not ids[one] & ids[two] and ids[one] | ids[two]
    for found in results.values():  # at most two to one endpoint per claimer
        per: dict[str, int] = {}
        for d in found:
            per[d.delivery.endpoint_id] = per.get(d.delivery.endpoint_id, 0) + 1
        assert max(per.values(), default=0) <= 2
        assert all(d.url == "http://127.0.0.1:9/hook" for d in found)
    # In flight counts against the cap: `one` sending two to `a` gets none of `a`'s.
    more = outbox.claim_due(db, one, 10, 30.0, now, in_flight={a: 2}, per_endpoint=2)
    assert all(d.delivery.endpoint_id == b for d in more)
    taken = ids[one] | ids[two] | {d.delivery.id for d in more}

    # A claim whose lease ran out is taken over.
    later = outbox.claim_due(db, two, 20, 30.0, now + 31, per_endpoint=20)
    assert taken <= {d.delivery.id for d in later}
    # A dead server's claims are free once its runner row is deleted (its recovery).
    three = runners.register(db, lease_seconds=60).id
    assert outbox.claim_due(db, three, 20, 30.0, now + 32, per_endpoint=20) == []
    runners.unregister(db, two)
    freed = outbox.claim_due(db, three, 20, 30.0, now + 32, per_endpoint=20)
    assert {d.delivery.id for d in freed} == {d.delivery.id for d in later}


def test_attempts_back_off_die_and_are_redelivered_with_the_same_id(db):
    e = endpoint(db, ALICE, ALL)
    _pending(db, 2, [e])
    me = runners.register(db, lease_seconds=60).id
    other = runners.register(db, lease_seconds=60).id
    now = time.time()

    def attempt(delivered: bool, at: float, who: str = me, retry: float = 5.0):  # type: ignore[no-untyped-def]
        (due,) = outbox.claim_due(db, who, 1, 30.0, at)
        row = outbox.record_attempt(
            db,
            due.delivery.id,
            who,
            delivered=delivered,
            status=200 if delivered else 503,
            error=None if delivered else "HTTP 503",
            retry_at=at + retry,
            max_attempts=3,
            now=at,
        )
        return due, row

    due, row = attempt(False, now)
    assert row.state == "pending" and row.attempts == 1 and row.next_attempt_at == now + 5.0
    assert row.claimed_by is None and row.last_status == 503 and row.last_error == "HTTP 503"
    # Not due yet: nothing to claim before its time (the other row first).
    first, _ = attempt(True, now + 1)
    assert first.delivery.id != due.delivery.id
    assert outbox.claim_due(db, me, 5, 30.0, now + 2) == []
    _, row = attempt(False, now + 5)
    _, row = attempt(False, now + 10)
    assert row.state == "dead" and row.attempts == 3
    assert outbox.counts(db) == {"pending": 0, "delivered": 1, "dead": 1}
    dead = outbox.list_deliveries(db, ALICE, e, state="dead")
    assert [d.id for d in dead or []] == [due.delivery.id]

    again = outbox.redeliver(db, ALICE, e, due.delivery.id, now + 20)
    assert again is not None and again.state == "pending" and again.attempts == 0
    assert outbox.redeliver(db, BOB, e, due.delivery.id, now + 20) is None  # not bob's
    (retried,) = outbox.claim_due(db, other, 5, 30.0, now + 20)
    assert retried.delivery.event_id == due.delivery.event_id
    assert retried.delivery.payload == due.delivery.payload
    # A server that lost its claim (lease ran out, taken over) records no failure...
    lost = outbox.record_attempt(
        db, due.delivery.id, me, delivered=False, status=None, error="x",
        retry_at=now + 99, max_attempts=3, now=now + 21,
    )  # fmt: skip
    assert lost is not None and lost.attempts == 0 and lost.claimed_by == other
    # ...but a delivery is a delivery, whoever records it; then it stays delivered.
    outbox.record_attempt(
        db, due.delivery.id, me, delivered=True, status=204, error=None,
        retry_at=0, max_attempts=3, now=now + 22,
    )  # fmt: skip
    final = outbox.record_attempt(
        db, due.delivery.id, other, delivered=False, status=500, error="late",
        retry_at=0, max_attempts=3, now=now + 23,
    )  # fmt: skip
    assert final is not None and final.state == "delivered" and final.last_status == 204
    # Deleting the endpoint deletes its deliveries.
    assert outbox.delete_endpoint(db, ALICE, e) is not None
    assert outbox.counts(db) == {"pending": 0, "delivered": 0, "dead": 0}


def test_doctor_reports_pending_and_dead_deliveries(tmp_path):
    from jupyter_lmsp import doctor

    db = open_db(tmp_path)
    try:
        e = endpoint(db, ALICE, ALL)
        _pending(db, 2, [e])
        me = runners.register(db, lease_seconds=60).id
        (due,) = outbox.claim_due(db, me, 1, 30.0, time.time())
        outbox.record_attempt(
            db, due.delivery.id, me, delivered=False, status=None, error="refused",
            retry_at=0, max_attempts=1, now=time.time(),
        )  # fmt: skip
    finally:
        db.dispose()
    diagnosis = doctor.examine(tmp_path / "lmsp.sqlite")
    assert diagnosis.webhooks == {"pending": 1, "delivered": 0, "dead": 1}
    text = doctor.render(diagnosis)
    assert "webhook deliveries: 1 pending, 1 dead (dead letters: GET" in text
