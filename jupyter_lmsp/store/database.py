"""Opening the database: SQLite (the embedded default) or PostgreSQL (a shared one).

SQLite: WAL, a busy timeout, and every write transaction starts with `BEGIN IMMEDIATE`, so a
transaction that reads a task's state and then changes it holds the write lock the whole time;
two such transactions (a cancel and a completion, say) run one after the other, never
interleaved. Reads use plain `BEGIN`.

Writers of one `Database` in this process take turns on a lock of its own before `BEGIN
IMMEDIATE` (issue 42). SQLite makes a writer that finds the file locked sleep and try again,
1, 2, 5, 10, 20 ms and longer, so under a burst of requests (creates on the request threads,
a claim on the runner's) a transaction waited up to ~25 ms after the lock was free. The
process's own lock wakes the next writer as soon as the last one commits; writers in other
processes still meet SQLite's busy timeout. Waiting longer than that timeout for it is the
same "database is locked" error SQLite gives, which the callers already retry.

PostgreSQL (`postgresql+psycopg://…`, psycopg 3): write transactions run at READ COMMITTED
side by side, and each rule locks the rows it reads before changing them (`SELECT … FOR
UPDATE`, see `store.dialect`), so the same two transactions still run one after the other on
the task they share. Reads are REPEATABLE READ, READ ONLY: one consistent snapshot, as on
SQLite. `synchronous_commit` stays on: a commit is durable before it returns.

Opening a database brings its schema to the current revision (`schema.prepare`: created when
empty, upgraded after a backup when older, refused when newer).

`grouped()` runs several rules in one transaction (the runner's database thread, issue 42):
inside it, on the same thread, each `writing()` is a savepoint of the group's transaction and
each `reading()` reads on its connection, so every rule sees what the rules before it wrote and
one that raises changes nothing, as if each were its own transaction; the group commits once
(one `BEGIN IMMEDIATE` and one sync to disk for all of them). Nothing of it is visible to
anyone before that commit.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import cast

from sqlalchemy import create_engine, event
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.pool import QueuePool

from . import (
    dialect,
    schema,
    tables,  # noqa: F401  (registers the tables on SQLModel.metadata)
)
from .private import private_database

BUSY_TIMEOUT_MS = 10_000


def sqlite_url(path: str | os.PathLike[str]) -> str:
    return f"sqlite:///{Path(path)}"


class Database:
    """One database, with the connection settings the section 11 rules rely on: a SQLite file
    or a PostgreSQL database (`dialect` says which)."""

    def __init__(self, url: str, *, upgrade: bool = True, legacy_owner: str | None = None) -> None:
        """Open the database at `url`, creating or upgrading its schema (see `schema.prepare`;
        with `upgrade` False an older schema is left as it is, for `jupyter lmsp doctor`)."""
        self.url = url
        self.path: Path | None = None
        # The connection of this thread's open `grouped()` transaction, if any.
        self._group = threading.local()
        # SQLite: taken by each write transaction before BEGIN IMMEDIATE (see the module
        # docstring). Reentrant: a thread that opens a second write transaction inside its
        # first (which would wait for itself) meets SQLite's busy timeout, as without it.
        self._writer: threading.RLock | None = None
        if url.startswith("postgresql+psycopg:"):
            self.dialect = dialect.POSTGRESQL
            self.engine: Engine = create_engine(
                url, poolclass=QueuePool, pool_size=4, max_overflow=16, pool_pre_ping=True
            )
            self.schema = schema.prepare(
                self.engine, None, upgrade=upgrade, legacy_owner=legacy_owner
            )
            return
        if not url.startswith("sqlite:"):
            raise ValueError(
                f"unsupported database URL {url!r}: a SQLite one (sqlite:///PATH) or a "
                "PostgreSQL one through psycopg 3 (postgresql+psycopg://USER@HOST:PORT/NAME)"
            )
        self.dialect = dialect.SQLITE
        self._writer = threading.RLock()
        path = url.removeprefix("sqlite:///")
        if path and path != ":memory:":
            self.path = Path(path)
            # 0600 before the first connection: the WAL and shared-memory files take its mode.
            private_database(path)
        # A small pool: a transaction checks a connection out and back in, so threads take
        # turns with connections but never share one at the same time. Keeping connections
        # open also keeps the WAL files in place between transactions, instead of SQLite
        # deleting and recreating them whenever the last connection closes.
        self.engine = create_engine(
            url,
            connect_args={"check_same_thread": False, "timeout": BUSY_TIMEOUT_MS / 1000},
            poolclass=QueuePool,
            pool_size=4,
            max_overflow=16,
        )
        event.listen(self.engine, "connect", _on_connect)
        event.listen(self.engine, "begin", _on_begin)
        self.schema = schema.prepare(
            self.engine, self.path, upgrade=upgrade, legacy_owner=legacy_owner
        )

    @property
    def is_postgres(self) -> bool:
        return self.dialect == dialect.POSTGRESQL

    @contextmanager
    def writing(self) -> Iterator[Connection]:
        """A write transaction on a SQLAlchemy Core connection (SQLite: BEGIN IMMEDIATE):
        commits on success, rolls back on error. The store's one style: Core statements
        executed on this connection. On PostgreSQL the rules lock the rows they change
        (`select(...).with_for_update()`, `records.advisory_lock`)."""
        group: Connection | None = getattr(self._group, "conn", None)
        if group is not None:
            # Inside `grouped()`: a savepoint, rolled back alone if the rule raises.
            with group.begin_nested():
                yield group
            return
        # SQLite: `_on_begin` starts it with BEGIN IMMEDIATE (the default of a connection that
        # says nothing else).
        with self._turn(), self.engine.connect() as conn, conn.begin():
            yield conn

    @contextmanager
    def _turn(self) -> Iterator[None]:
        """This process's turn to write (SQLite; see the module docstring)."""
        writer = self._writer
        if writer is None:
            yield
            return
        if not writer.acquire(timeout=BUSY_TIMEOUT_MS / 1000):
            raise sqlite3.OperationalError("database is locked")
        try:
            yield
        finally:
            writer.release()

    @contextmanager
    def grouped(self) -> Iterator[None]:
        """One write transaction for every `writing()` and `reading()` this thread enters
        until it ends (see the module docstring): committed at the end, rolled back whole if
        the block raises."""
        if getattr(self._group, "conn", None) is not None:
            yield  # already in one: the outer group commits
            return
        with self.writing() as conn:
            self._group.conn = conn
            try:
                yield
            finally:
                self._group.conn = None

    @contextmanager
    def reading(self) -> Iterator[Connection]:
        """A read transaction on a SQLAlchemy Core connection: one consistent snapshot of the
        database (SQLite: a deferred BEGIN; PostgreSQL: REPEATABLE READ, READ ONLY), nothing
        written; rolled back at the end. Inside `grouped()`: the group's connection, which
        sees what the group wrote so far."""
        group: Connection | None = getattr(self._group, "conn", None)
        if group is not None:
            # A savepoint all the same: a read that fails must not spoil the group's
            # transaction (on PostgreSQL an error aborts it up to the last savepoint).
            with group.begin_nested():
                yield group
            return
        with self.engine.connect() as conn:
            if self.dialect == dialect.SQLITE:
                conn = conn.execution_options(lmsp_begin="DEFERRED")
            else:
                conn = conn.execution_options(
                    isolation_level="REPEATABLE READ", postgresql_readonly=True
                )
            with conn.begin() as transaction:
                yield conn
                transaction.rollback()

    def dispose(self) -> None:
        self.engine.dispose()


def _on_connect(dbapi_connection: sqlite3.Connection, _record: object) -> None:
    # Let SQLAlchemy's "begin" event issue BEGIN itself instead of pysqlite's implicit one.
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    cursor.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
    _enable_wal(cursor)
    # FULL: a commit is on disk before it returns, so a 202 written after it survives even a
    # power loss, not only a kill -9. Measured here: 0.24 ms a commit against 0.02 ms for NORMAL.
    cursor.execute("PRAGMA synchronous=FULL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def _on_begin(conn: Connection) -> None:
    mode = conn.get_execution_options().get("lmsp_begin", "IMMEDIATE")
    # On the driver's connection itself: through `exec_driver_sql` this statement cost as
    # much CPU as one of the transaction's own (~15 µs), on every transaction.
    driver = cast(sqlite3.Connection, conn.connection.driver_connection)
    driver.execute(_BEGIN[mode]).close()


_BEGIN = {"IMMEDIATE": "BEGIN IMMEDIATE", "DEFERRED": "BEGIN DEFERRED"}


def _enable_wal(cursor: sqlite3.Cursor) -> None:
    """Switch to WAL. The switch needs the database to itself and SQLite may answer "locked"
    at once instead of waiting (seen when two processes open an old database together while
    one migrates it): retry until the busy timeout."""
    deadline = time.monotonic() + BUSY_TIMEOUT_MS / 1000
    while True:
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.02)
