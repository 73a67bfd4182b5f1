"""Which database errors mean "run the transaction again": it was rolled back because another
writer held the lock too long (SQLite) or collided with it (PostgreSQL), and changed nothing.
The runner's database thread (`services.committer`) asks, knowing neither driver.

`is_storage_full`: the write failed for lack of space (SQLite's SQLITE_FULL, "database or
disk is full"; PostgreSQL's class 53, insufficient resources). The transaction changed
nothing; it can succeed once space returns (issue 43).
"""

from __future__ import annotations

import sqlite3

# PostgreSQL's serialization_failure and deadlock_detected.
_PG_RETRYABLE = frozenset({"40001", "40P01"})
# SQLite's extended result codes whose primary code is SQLITE_FULL (13) or SQLITE_IOERR (10):
# on a full disk a write may fail with either (an I/O error while growing the WAL).
_SQLITE_FULL = 13
_SQLITE_IOERR = 10


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


def is_storage_full(exc: BaseException) -> bool:
    """The database could not write for lack of space (or an I/O error writing), raised
    directly or wrapped by SQLAlchemy."""
    for error in (exc, getattr(exc, "orig", None)):
        if isinstance(error, sqlite3.OperationalError | sqlite3.DatabaseError):
            code = getattr(error, "sqlite_errorcode", None)
            if code is not None and code & 0xFF in (_SQLITE_FULL, _SQLITE_IOERR):
                return True
            if "disk is full" in str(error) or "disk I/O error" in str(error):
                return True
        state = getattr(error, "sqlstate", None)
        if isinstance(state, str) and state.startswith("53"):
            return True
    return False
