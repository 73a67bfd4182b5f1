"""Committed events reach every server's watchers on PostgreSQL through LISTEN/NOTIFY
(store.notify, services.feed).

What these tests prove, on a real PostgreSQL cluster:

- the trigger announces each committed event with its task id and sequence number, only when
  its transaction commits (a rolled-back one announces nothing);
- a feed listening on one `Database` delivers, on its bus, the events another `Database` (as
  another server) commits, in order and each once, well before its periodic full read would
  (which the test pushes out of reach): the notifications, not polling, brought them;
- events committed while no feed listened (a notification missed) are still delivered, read
  from the table when the feed starts;
- a cancel another server commits for a task this server's runner holds is noticed through
  the notification of its `cancelling` event.

A feed says when it listens (`EventFeed.listening`): the tests commit only after that.
"""

from __future__ import annotations

import asyncio
import time

import psycopg
import pytest
from feedhelpers import idle_runner, listening
from sqlalchemy import insert, update
from storehelpers import make_task, new_task, to_running

from jupyter_lmsp.services import feed as feed_module
from jupyter_lmsp.services.bus import EventBus
from jupyter_lmsp.services.feed import EventFeed
from jupyter_lmsp.store import notify, rules
from jupyter_lmsp.store.database import Database
from jupyter_lmsp.store.tables import Runner, Task, TaskEvent

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def two(pg_url):
    """Two stores on one PostgreSQL database, as two servers have."""
    here, there = Database(pg_url), Database(pg_url)
    yield here, there
    here.dispose()
    there.dispose()


def test_the_trigger_announces_committed_events_only(pg_url):
    db = Database(pg_url)
    dsn = pg_url.replace("postgresql+psycopg://", "postgresql://")
    try:
        with psycopg.connect(dsn, autocommit=True) as listener:
            listener.execute(f"LISTEN {notify.CHANNEL}")
            tid = make_task(db, "running")
            got = [notify.parse(n.payload) for n in listener.notifies(timeout=1.0)]
            n_events = len(rules_events(db, tid))
            assert got == [(tid, seq) for seq in range(n_events)]
            # A transaction that rolls back announces nothing.
            with pytest.raises(RuntimeError), db.writing() as conn:
                conn.execute(
                    insert(TaskEvent.__table__).values(
                        task_id=tid, sequence_number=999, type="x", data="{}", created_at=0
                    )
                )
                raise RuntimeError("rolled back")
            assert list(listener.notifies(timeout=0.5)) == []
    finally:
        db.dispose()


def rules_events(db, tid):
    from jupyter_lmsp.store import queries

    return queries.list_events(db, tid)


def _collect(sub, until_type, timeout):
    async def run():
        got = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            item = await sub.get(timeout=0.1)
            if item is not None:
                got.append(item[1])
                if item[1]["type"] == until_type:
                    break
        return got

    return run()


def test_events_committed_by_another_server_arrive_by_notification(two, tmp_path, monkeypatch):
    here, there = two
    # The periodic full read out of reach: only notifications can bring the events in time.
    monkeypatch.setattr(feed_module, "FULL_POLL_SECONDS", 3600.0)
    task, response = new_task()
    rules.create_task(there, task, response)
    tid = task.id

    async def scenario():
        bus = EventBus()
        bus.bind(asyncio.get_running_loop())
        feed = EventFeed(here, bus, idle_runner(here, bus, tmp_path), interval=0.02)
        sub = bus.subscribe(tid)
        sub.seen(0)  # the watcher read the log up to `response.created`
        feed.start(asyncio.get_running_loop())
        try:
            await listening(feed)
            started = time.monotonic()
            writer = asyncio.get_running_loop().run_in_executor(None, _drive, there, tid)
            got = await _collect(sub, "response.completed", timeout=20)
            await writer
            return got, time.monotonic() - started
        finally:
            feed.stop()
            sub.close()

    got, elapsed = asyncio.run(scenario())
    stored = rules_events(there, tid)
    assert got == stored[1:]  # every event after the one read, once, in order
    assert elapsed < 10, elapsed


def _drive(db, tid):
    to_running(db, tid)
    for i in range(5):
        rules.append_output(db, tid, [i], f" {i}")
        time.sleep(0.02)
    from storehelpers import usage

    rules.finish(db, tid, rules.Outcome("completed", usage=usage()))


def test_events_committed_before_the_feed_listened_are_read_from_the_table(two, tmp_path):
    here, there = two
    tid = make_task(there, "running")

    async def scenario():
        bus = EventBus()
        bus.bind(asyncio.get_running_loop())
        sub = bus.subscribe(tid)
        sub.seen(0)
        feed = EventFeed(here, bus, idle_runner(here, bus, tmp_path), interval=0.02)
        feed.start(asyncio.get_running_loop())  # after every commit: no notification comes
        try:
            return await _collect(sub, "response.output_text.delta#never", timeout=3)
        finally:
            feed.stop()
            sub.close()

    got = asyncio.run(scenario())
    assert got == rules_events(there, tid)[1:]


def test_a_cancel_committed_elsewhere_reaches_the_runner_holding_the_task(
    two, tmp_path, monkeypatch
):
    here, there = two
    monkeypatch.setattr(feed_module, "FULL_POLL_SECONDS", 3600.0)
    tid = make_task(here, "running")
    noticed: list[list[str]] = []

    async def scenario():
        bus = EventBus()
        bus.bind(asyncio.get_running_loop())
        runner = idle_runner(here, bus, tmp_path)
        runner.runner_id = "runner_here"
        # As if its generation ran here: queued, then given a slot.
        runner.slots.push(tid, owner="")
        assert [t.task_id for t in runner.slots.to_claim()] == [tid]
        runner.notice_cancelled = noticed.append  # type: ignore[method-assign]
        with here.writing() as conn:
            conn.execute(
                insert(Runner.__table__).values(
                    id="runner_here",
                    kind="server",
                    host="h",
                    boot_id="b",
                    pid=1,
                    process_started_at=0,
                    label="",
                    started_at=0,
                    heartbeat_at=0,
                    lease_expires_at=1e12,
                )
            )
            conn.execute(
                update(Task.__table__)
                .where(Task.__table__.c.id == tid)
                .values(runner_id="runner_here")
            )
        feed = EventFeed(here, bus, runner, interval=0.02)
        feed.start(asyncio.get_running_loop())
        try:
            await listening(feed)
            await asyncio.get_running_loop().run_in_executor(None, rules.request_cancel, there, tid)
            deadline = time.monotonic() + 5
            while not noticed and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
        finally:
            feed.stop()

    asyncio.run(scenario())
    assert noticed == [[tid]]
