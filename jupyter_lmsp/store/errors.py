"""Which database errors mean "run the transaction again": it was rolled back because another
writer held the lock too long (SQLite) or collided with it (PostgreSQL), and changed nothing.
The runner's database thread (`services.committer`) asks, knowing neither driver.
"""

from __future__ import annotations

import sqlite3

# PostgreSQL's serialization_failure and deadlock_detected.
_PG_RETRYABLE = frozenset({"40001", "40P01"})


def is_locked(exc: BaseException) -> bool:
    """SQLite's "database is locked" / "busy", or PostgreSQL's deadlock or serialization
    failure (the transaction was rolled back and may simply run again), raised directly or
    wrapped by SQLAlchemy."""
    for error in (exc, getattr(exc, "orig", None)):
        if isinstance(error, sqlite3.OperationalError) and (
            "locked" in str(error) or "busy" in str(error)
        ):
            return True
        if getattr(error, "sqlstate", None) in _PG_RETRYABLE:
            return True
    return False
