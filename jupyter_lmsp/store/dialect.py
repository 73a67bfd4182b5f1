"""What differs between the two backends, SQLite and PostgreSQL, below the rules.

The rules' hot paths run plain SQL on a DB-API cursor (`Database.write_cursor`), written once
in SQLite's parameter style (`?`, `:name`). On PostgreSQL (psycopg 3) the cursor is a
`PgCursor`, which rewrites each statement to psycopg's style (`%s`, `%(name)s`) once and caches
it, and hands rows back as `Row`s: tuples that also answer `row["column"]` and `dict(row)`,
as `sqlite3.Row` does.

Locks: SQLite serialises writers (`BEGIN IMMEDIATE` takes the one write lock up front), so a
rule that reads a row and then changes it needs nothing more. PostgreSQL runs writers side by
side (READ COMMITTED), so the rules lock the rows they read before changing them (`SELECT …
FOR UPDATE`, `for_update` below) and, where the row to lock may not exist yet (an idempotency
key being claimed, an owner's quota over rows still to be inserted), take a transaction-scoped
advisory lock on its name (`advisory_lock`).
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Iterable, Iterator, Sequence
from functools import lru_cache
from typing import Any, Protocol

SQLITE = "sqlite"
POSTGRESQL = "postgresql"


class Cursor(Protocol):
    """The DB-API cursor the plain-SQL paths use: sqlite3's, or a `PgCursor`."""

    @property
    def rowcount(self) -> int: ...

    def execute(self, sql: str, parameters: Any = ..., /) -> Any: ...

    def executemany(self, sql: str, seq_of_parameters: Iterable[Any], /) -> Any: ...

    def fetchone(self) -> Any: ...

    def fetchall(self) -> list[Any]: ...


class SqliteCursor(sqlite3.Cursor):
    """sqlite3's cursor, saying which backend it is on."""

    dialect = SQLITE


def dialect_of(cursor: Any) -> str:
    return getattr(cursor, "dialect", SQLITE)


class Row(tuple[Any, ...]):
    """A result row: a tuple that is also a read-only mapping of column names (as
    `sqlite3.Row`: `row[0]`, `row["id"]`, `dict(row)`, unpacking)."""

    names: tuple[str, ...]

    def __new__(cls, values: Sequence[Any], names: tuple[str, ...]) -> Row:
        row = super().__new__(cls, values)
        row.names = names
        return row

    def keys(self) -> tuple[str, ...]:
        return self.names

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, str):
            return tuple.__getitem__(self, self.names.index(key))
        return tuple.__getitem__(self, key)


def _row_factory(cursor: Any) -> Any:
    description = cursor.description
    if description is None:
        return tuple
    names = tuple(column.name for column in description)
    return lambda values: Row(values, names)


_NAMED = re.compile(r"(?<![:\w]):(\w+)")


@lru_cache(maxsize=512)
def to_pyformat(sql: str) -> str:
    """A statement in SQLite's parameter style (`?`, `:name`) in psycopg's (`%s`, `%(name)s`)."""
    sql = sql.replace("%", "%%").replace("?", "%s")
    return _NAMED.sub(r"%(\1)s", sql)


class PgCursor:
    """A psycopg cursor that takes statements in SQLite's parameter style (see the module
    docstring)."""

    dialect = POSTGRESQL

    def __init__(self, connection: Any) -> None:
        self._cursor = connection.cursor(row_factory=_row_factory)

    @property
    def rowcount(self) -> int:
        return int(self._cursor.rowcount)

    def execute(self, sql: str, parameters: Any = None, /) -> PgCursor:
        self._cursor.execute(to_pyformat(sql), () if parameters is None else parameters)
        return self

    def executemany(self, sql: str, seq_of_parameters: Iterable[Any], /) -> PgCursor:
        rows = list(seq_of_parameters)
        if rows:
            self._cursor.executemany(to_pyformat(sql), rows)
        return self

    def fetchone(self) -> Any:
        return self._cursor.fetchone()

    def fetchall(self) -> list[Any]:
        return list(self._cursor.fetchall())

    def __iter__(self) -> Iterator[Any]:
        return iter(self._cursor)

    def close(self) -> None:
        self._cursor.close()


def for_update(dialect: str) -> str:
    """The clause that locks the rows a SELECT returns until the transaction ends (nothing on
    SQLite, whose write transactions hold the database's one write lock already)."""
    return " FOR UPDATE" if dialect == POSTGRESQL else ""


def advisory_lock(cursor: Any, name: str) -> None:
    """Hold a lock on `name` until the transaction ends, on PostgreSQL (on SQLite the write
    transaction already excludes every other writer). For rows that may not exist yet."""
    if dialect_of(cursor) == POSTGRESQL:
        cursor.execute("SELECT pg_advisory_xact_lock(hashtext(?))", (name,))
