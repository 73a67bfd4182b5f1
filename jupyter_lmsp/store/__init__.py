"""Persistence (LMSP section 11): SQLModel tables on SQLite, and the section 11 rules as transactions.

`tables` defines the tables of 11.1 (and `pairings`, `runners`), `database` opens SQLite the
way the rules need it (WAL, busy timeout, write transactions that take the lock up front),
`schema` versions it (Alembic migrations in `migrations/`), `rules` holds one transactional
function per rule of 11.2 and 11.3, `runners` the leases of the processes that drive tasks,
`queries` the read-only look-ups, `backup` online copies.

What is SQLite's own, for a second backend (PostgreSQL) to replace: `database` (connection
pragmas, `BEGIN IMMEDIATE` where PostgreSQL takes `SELECT … FOR UPDATE`), `schema`'s foreign
keys off during migrations, `backup` (SQLite's backup API), the plain-`sqlite3` hot paths of
`rules` (`create_task`, `append_outputs`, `recover_runner`, through `Database.write_cursor`)
and `runners.renew`, and `services.feed` (polling `PRAGMA data_version` where PostgreSQL has
`LISTEN/NOTIFY`). Everything else goes through SQLAlchemy.
"""

from .database import Database

__all__ = ["Database"]
