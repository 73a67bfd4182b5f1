"""What other servers commit to the shared database, read for the event feed (`services.feed`).

A `ChangeWatch` is one connection of its own to the database (never one of the pool's: it is
held as long as the feed runs, and on PostgreSQL it listens), in autocommit: each read is its
own snapshot, as the feed wants the newest commits. The service drives it from one thread:

- What changed since the last look. On SQLite, `changed()` compares `PRAGMA data_version`,
  which changes when another connection commits: "something" (`EVERYTHING`) or nothing; the
  service decides how often to look. On PostgreSQL, `wait(timeout)` waits up to `timeout` for
  the notifications of `store.notify` (`LISTEN lmsp_events`) and answers with the ids of the
  tasks they name.
- `events(watched)`: the events of these tasks after these sequence numbers, from the table
  (the log is the source: a missed change costs latency, never an event).
- `cancelling(runner_id)`: which of the tasks that runner holds are committed `cancelling`.

Both reads are Core statements built once (per number of tasks read). The two looks use the
driver's own connection under the SQLAlchemy one: psycopg's `notifies()` has no SQLAlchemy
form, and `PRAGMA data_version` through the driver costs ~10 us against ~80 us as a Core
statement (measured here), run every 20 ms by every server on the database that watches or
runs a task. Any error of the database or its driver comes out as `FeedError` (its cause the
driver's), so the service reconnects without knowing the drivers.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from functools import lru_cache
from typing import Any

from sqlalchemy import Select, and_, bindparam, create_engine, event, or_, select, text
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.pool import NullPool

from ..protocol.states import TaskState
from . import notify
from .database import Database
from .records import DriverStatement, table
from .tables import Task, TaskEvent

# What `wait` answers when anything may have changed (SQLite cannot say what).
EVERYTHING = None
# Tasks read by one statement, at most (far below SQLite's limit on parameters).
TASKS_PER_READ = 200

_events = table(TaskEvent)
_tasks = table(Task)
_CANCELLING = select(_tasks.c.id).where(
    _tasks.c.runner_id == bindparam("runner_id"), _tasks.c.state == TaskState.CANCELLING
)
_LISTEN = text(f"LISTEN {notify.CHANNEL}")


class FeedError(RuntimeError):
    """Reading or listening to the shared database failed (the cause says why); the watch is
    closed, and a new one may be opened."""


@lru_cache(maxsize=64)
def _events_of(n: int) -> Select[Any]:
    """The events of `n` tasks, each after its own sequence number, in order per task."""
    wanted = or_(
        *(
            and_(
                _events.c.task_id == bindparam(f"t{i}"),
                _events.c.sequence_number > bindparam(f"a{i}"),
            )
            for i in range(n)
        )
    )
    return (
        select(_events.c.task_id, _events.c.data)
        .where(wanted)
        .order_by(_events.c.task_id, _events.c.sequence_number)
    )


class ChangeWatch:
    """One connection that learns of other servers' commits (see the module docstring).
    Open it with `opened()`; use it from one thread."""

    def __init__(self, db: Database) -> None:
        self.postgres = db.is_postgres
        # PostgreSQL names the tasks that changed; SQLite only says something did.
        self.names_tasks = self.postgres
        self._engine: Engine = create_engine(
            db.engine.url,
            poolclass=NullPool,
            isolation_level="AUTOCOMMIT",
            **({} if self.postgres else {"connect_args": {"timeout": 10}}),
        )
        if not self.postgres:
            event.listen(self._engine, "connect", _read_only)
        self._conn: Connection | None = None
        self._driver: Any = None
        self._version: int | None = None
        self._cancelling: DriverStatement | None = None
        # The driver's own errors, which its calls below SQLAlchemy raise unwrapped.
        self._driver_errors: tuple[type[Exception], ...] = (sqlite3.Error,)
        if self.postgres:
            import psycopg

            self._driver_errors = (psycopg.Error,)

    @contextmanager
    def opened(self) -> Iterator[ChangeWatch]:
        """Connect (and on PostgreSQL, listen); closed at the end, also after a `FeedError`."""
        try:
            with self._errors():
                self._conn = self._engine.connect()
                self._driver = self._conn.connection.driver_connection
                if self.postgres:
                    self._conn.execute(_LISTEN)
                else:
                    self._version = self._data_version()
            yield self
        finally:
            self.close()

    def close(self) -> None:
        conn, self._conn, self._driver = self._conn, None, None
        if conn is not None:
            # A broken connection may fail to close; it is gone either way.
            with contextlib.suppress(Exception):
                conn.close()

    def dispose(self) -> None:
        self.close()
        self._engine.dispose()

    def changed(self) -> set[str] | None:
        """(SQLite) `EVERYTHING` if another connection committed since the last look, else an
        empty set. It never waits: the service paces its looks."""
        with self._errors():
            now = self._data_version()
            if now == self._version:
                return set()
            self._version = now
            return EVERYTHING

    def wait(self, timeout: float) -> set[str]:
        """(PostgreSQL) The tasks named by the notifications that arrive within `timeout` (an
        empty set if none does)."""
        with self._errors():
            named: set[str] = set()
            for note in self._driver.notifies(timeout=timeout, stop_after=1):
                _add(named, note.payload)
            # Whatever else arrived meanwhile, without waiting.
            for note in self._driver.notifies(timeout=0):
                _add(named, note.payload)
            return named

    def events(self, watched: Mapping[str, int]) -> list[tuple[str, list[dict[str, Any]]]]:
        """The committed events of each task in `watched` after its sequence number there, in
        order (tasks with none left out)."""
        found: dict[str, list[dict[str, Any]]] = {}
        items = list(watched.items())
        with self._errors():
            conn = self._connection()
            for start in range(0, len(items), TASKS_PER_READ):
                chunk = items[start : start + TASKS_PER_READ]
                params: dict[str, Any] = {}
                for i, (task_id, after) in enumerate(chunk):
                    params[f"t{i}"] = task_id
                    params[f"a{i}"] = after
                for task_id, data in conn.execute(_events_of(len(chunk)), params):
                    found.setdefault(task_id, []).append(json.loads(data))
        return [(task_id, found[task_id]) for task_id, _ in items if task_id in found]

    def cancelling(self, runner_id: str) -> set[str]:
        """The tasks `runner_id` holds that are committed `cancelling` (after every commit
        anywhere: on the driver's connection, `records.DriverStatement`)."""
        with self._errors():
            conn = self._connection()
            if self._cancelling is None:
                self._cancelling = DriverStatement(_CANCELLING, conn.dialect)
            rows = self._cancelling.rows(self._driver, {"runner_id": runner_id})
            return {str(task_id) for (task_id,) in rows}

    def _connection(self) -> Connection:
        if self._conn is None:
            raise FeedError("the watch is not open")
        return self._conn

    @contextmanager
    def _errors(self) -> Iterator[None]:
        """The database's and the driver's errors as `FeedError`."""
        try:
            yield
        except SQLAlchemyError as exc:
            raise FeedError(str(exc)) from exc
        except self._driver_errors as exc:
            raise FeedError(str(exc)) from exc

    def _data_version(self) -> int:
        (version,) = self._driver.execute("PRAGMA data_version").fetchone()
        return int(version)


def _add(named: set[str], payload: str) -> None:
    parsed = notify.parse(payload)
    if parsed is not None:
        named.add(parsed[0])


def _read_only(dbapi_connection: Any, _record: object) -> None:
    # This connection only reads: SQLite refuses any write on it.
    dbapi_connection.execute("PRAGMA query_only=1")
