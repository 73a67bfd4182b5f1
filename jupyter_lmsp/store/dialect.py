"""What differs between the two backends, SQLite and PostgreSQL, below the rules.

The store writes every statement once, as SQLAlchemy Core, and SQLAlchemy renders it in each
backend's dialect (parameter style included). What the rules must still know:

Locks: SQLite serialises writers (`BEGIN IMMEDIATE` takes the one write lock up front), so a
rule that reads a row and then changes it needs nothing more. PostgreSQL runs writers side by
side (READ COMMITTED), so the rules lock the rows they read before changing them
(`select(...).with_for_update()`, which SQLAlchemy leaves out on SQLite; `skip_locked=True`
for claims from the shared queue) and, where the row to lock may not exist yet (an
idempotency key being claimed, an owner's quota over rows still to be inserted), take a
transaction-scoped advisory lock on its name (`records.advisory_lock`). Upserts are each
dialect's own `insert(...).on_conflict_do_update` (`insert_of`).

The dialects' modules are imported when first asked for: SQLAlchemy's PostgreSQL package costs a
SQLite server ~20 ms of its start (its asyncpg dialect included) for statements it never runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

SQLITE = "sqlite"
POSTGRESQL = "postgresql"


def insert_of(name: str) -> Callable[..., Any]:
    """The `insert` of the dialect `name` (`Connection.dialect.name`): with its
    `on_conflict_do_update` / `on_conflict_do_nothing`."""
    if name == POSTGRESQL:
        from sqlalchemy.dialects import postgresql

        return postgresql.insert
    from sqlalchemy.dialects import sqlite

    return sqlite.insert


def json_type(name: str) -> Any:
    """The JSON type of the dialect `name` (PostgreSQL's has `.astext`)."""
    if name == POSTGRESQL:
        from sqlalchemy.dialects import postgresql

        return postgresql.JSON
    from sqlalchemy.dialects import sqlite

    return sqlite.JSON
