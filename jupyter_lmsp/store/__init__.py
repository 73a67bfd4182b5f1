"""Persistence (LMSP section 11): SQLModel tables on SQLite, and the section 11 rules as transactions.

`tables` defines the seven tables of 11.1, `database` opens SQLite the way the rules need it
(WAL, busy timeout, write transactions that take the lock up front), `rules` holds one
transactional function per rule of 11.2 and 11.3, and `queries` the read-only look-ups.
"""

from .database import Database

__all__ = ["Database"]
