"""Writers of one SQLite `Database` in this process take turns on its own lock (issue 42), on a
real file:

- a second writer waits for the first to commit, even where SQLite itself would not wait at
  all (a busy timeout of 0 makes `BEGIN IMMEDIATE` on a locked file fail at once): the turn
  is taken before SQLite is asked, and given as the first commits;
- a writer that waits longer than the busy timeout for its turn gets the error SQLite gives
  (`database is locked`), which the callers already retry (`store.errors.is_locked`);
- a write transaction opened inside another on the same thread does not wait for itself
  forever: it meets SQLite's busy timeout, as without the lock.
"""

from __future__ import annotations

import sqlite3
import threading

import pytest
from sqlalchemy import event
from storehelpers import open_db

from jupyter_lmsp.store import database
from jupyter_lmsp.store.errors import is_locked


@pytest.fixture
def db(tmp_path):
    store = open_db(tmp_path)
    yield store
    store.dispose()


def _busy_timeout(db: database.Database, ms: int) -> None:
    """SQLite's own busy timeout on every connection opened from now on (after the store's)."""

    def set_timeout(dbapi_connection: sqlite3.Connection, _record: object) -> None:
        dbapi_connection.execute(f"PRAGMA busy_timeout={ms}").close()

    event.listen(db.engine, "connect", set_timeout)
    db.engine.dispose()  # the pooled connections had the store's


def _hold(db: database.Database, inside: threading.Event, release: threading.Event) -> None:
    with db.writing() as conn:
        conn.exec_driver_sql("SELECT 1")
        inside.set()
        assert release.wait(30)


def test_a_second_writer_waits_for_the_first_to_commit(db):
    _busy_timeout(db, 0)
    inside, release = threading.Event(), threading.Event()
    first = threading.Thread(target=_hold, args=(db, inside, release))
    first.start()
    assert inside.wait(30)
    order: list[str] = []
    asking = threading.Event()

    def second() -> None:
        asking.set()
        with db.writing() as conn:  # BEGIN IMMEDIATE: the write lock, or "locked" at once
            conn.exec_driver_sql("SELECT 1")
            order.append("second wrote")

    writer = threading.Thread(target=second)
    writer.start()
    assert asking.wait(30)
    writer.join(0.3)
    assert writer.is_alive() and order == []  # waiting for its turn, not failed
    order.append("first commits")
    release.set()
    first.join(30)
    writer.join(30)
    assert order == ["first commits", "second wrote"]


def test_waiting_past_the_busy_timeout_is_database_is_locked(db, monkeypatch):
    monkeypatch.setattr(database, "BUSY_TIMEOUT_MS", 100)
    inside, release = threading.Event(), threading.Event()
    first = threading.Thread(target=_hold, args=(db, inside, release))
    first.start()
    try:
        assert inside.wait(30)
        with pytest.raises(Exception) as refused, db.writing():
            pass
        assert is_locked(refused.value)
    finally:
        release.set()
        first.join(30)
    with db.writing() as conn:  # the turn was given back
        conn.exec_driver_sql("SELECT 1")


def test_a_write_inside_a_write_on_one_thread_meets_the_busy_timeout(db):
    _busy_timeout(db, 100)
    with db.writing(), pytest.raises(Exception) as refused, db.writing():
        pass
    assert is_locked(refused.value)
