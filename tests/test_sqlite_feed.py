"""The feed of other servers' commits on SQLite (services.feed) looks at the database often only
while there is something to look for.

On a real SQLite file shared by two `Database`s (as two servers on one data folder):

- idle (nothing watched, no task held), the feed looks about once per `IDLE_SECONDS`, not
  every `interval`;
- a task becoming watched wakes it at once: another server's events reach the watcher in a
  fraction of `IDLE_SECONDS` (which the test makes a minute long, so only the wake can bring
  them in time), in order and each once;
- a task taking one of the runner's slots wakes it too, and while it holds one the feed looks
  every `interval` (another server may cancel that task).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
from feedhelpers import idle_runner, listening
from storehelpers import new_task, open_db, to_running

from jupyter_lmsp.services import feed as feed_module
from jupyter_lmsp.services.bus import EventBus
from jupyter_lmsp.services.fairqueue import Tier
from jupyter_lmsp.services.feed import EventFeed
from jupyter_lmsp.store import queries, rules
from jupyter_lmsp.store.feed import ChangeWatch

pytestmark = pytest.mark.timeout(120)

INTERVAL = 0.02


@pytest.fixture
def two(tmp_path):
    """Two stores on one SQLite file, as two servers on one data folder have."""
    here = open_db(tmp_path)
    there = open_db(tmp_path)
    yield here, there
    here.dispose()
    there.dispose()


@pytest.fixture
def looks(monkeypatch):
    """The times the feed looked at the database (`PRAGMA data_version`)."""
    seen: list[float] = []
    original = ChangeWatch._data_version

    def counted(self):  # type: ignore[no-untyped-def]
        seen.append(time.monotonic())
        return original(self)

    monkeypatch.setattr(ChangeWatch, "_data_version", counted)
    return seen


@contextlib.asynccontextmanager
async def started(db, tmp_path, runner=None):
    """A feed on `db` with its bus (and an idle runner, unless given), listening; stopped after."""
    bus = EventBus()
    bus.bind(asyncio.get_running_loop())
    runner = runner or idle_runner(db, bus, tmp_path)
    feed = EventFeed(db, bus, runner, interval=INTERVAL)
    feed.start(asyncio.get_running_loop())
    try:
        await listening(feed)
        yield bus, runner
    finally:
        feed.stop()


def test_an_idle_feed_looks_seldom(two, tmp_path, looks, monkeypatch):
    here, _ = two
    monkeypatch.setattr(feed_module, "IDLE_SECONDS", 0.5)

    async def scenario():
        async with started(here, tmp_path):
            before = len(looks)
            await asyncio.sleep(1.6)
            return len(looks) - before

    n = asyncio.run(scenario())
    # Every 0.5 s: three or four looks in 1.6 s (every `interval`, it would be ~80); at least
    # one even on a machine too busy to wake the thread on time.
    assert 1 <= n <= 5, n


def test_a_task_becoming_watched_wakes_the_feed(two, tmp_path, looks, monkeypatch):
    here, there = two
    monkeypatch.setattr(feed_module, "IDLE_SECONDS", 60.0)
    task, response = new_task()
    rules.create_task(there, task, response)
    tid = task.id

    async def scenario():
        async with started(here, tmp_path) as (bus, _):
            await asyncio.sleep(0.3)
            idle_looks = len(looks)
            sub = bus.subscribe(tid)
            sub.seen(0)  # the watcher read the log up to `response.created`
            began = time.monotonic()
            await asyncio.get_running_loop().run_in_executor(None, to_running, there, tid)
            got = []
            while time.monotonic() - began < 20 and len(got) < 4:
                item = await sub.get(timeout=0.1)
                if item is not None:
                    got.append(item[1])
            sub.close()
            return got, time.monotonic() - began, idle_looks

    got, elapsed, idle_looks = asyncio.run(scenario())
    # Idle, it looked once on opening and once more at most (the next look was a minute away).
    assert idle_looks <= 2, idle_looks
    stored = queries.list_events(there, tid)
    assert got == stored[1:5]  # every event after the one read, once, in order
    assert elapsed < 5, elapsed


def test_a_task_taking_a_slot_wakes_the_feed(two, tmp_path, looks, monkeypatch):
    here, _ = two
    monkeypatch.setattr(feed_module, "IDLE_SECONDS", 60.0)

    async def scenario():
        async with started(here, tmp_path) as (_, runner):
            await asyncio.sleep(0.3)
            idle_looks = len(looks)
            assert runner.slots.reserve("task_held", "owner", 1, Tier.DEFAULT)
            taken = len(looks)
            await asyncio.sleep(1.0)
            return idle_looks, len(looks) - taken

    idle_looks, held_looks = asyncio.run(scenario())
    assert idle_looks <= 2, idle_looks
    # Every `interval` while the task is held: ~50 looks in 1 s (without the wake, none).
    assert held_looks >= 8, held_looks
