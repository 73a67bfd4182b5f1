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
dialect's own `insert(...).on_conflict_do_update`.
"""

from __future__ import annotations

SQLITE = "sqlite"
POSTGRESQL = "postgresql"
