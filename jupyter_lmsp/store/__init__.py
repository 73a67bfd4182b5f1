"""Persistence (LMSP section 11): SQLModel tables on SQLite, and the section 11 rules as transactions.

All of the service's SQL is here, in one style: SQLAlchemy Core statements executed on the
`Connection` that `Database.writing()` / `Database.reading()` yield, their rows handed out as
the table models of `tables` (`records`). Above the store nothing imports a database driver
or SQLAlchemy (the import-linter contract `no-sql-above-the-store`).

`tables` defines the tables of 11.1 (and `pairings`, `runners`), `database` opens SQLite the
way the rules need it (WAL, busy timeout, write transactions that take the lock up front),
`schema` versions it (Alembic migrations in `migrations/`), `rules` holds one transactional
function per rule of 11.2 and 11.3, `runners` the leases of the processes that drive tasks,
`queries` the read-only look-ups, `clients`, `idempotency` and `models` their tables,
`quotas` the count admission checks inside `create_task`, `feed` what other servers commit
(read for `services.feed`), `inventory` what `jupyter lmsp doctor` reports, `errors` which
errors mean "run the transaction again", `backup` online copies.

Two backends: SQLite (the embedded default) and PostgreSQL (`postgresql+psycopg://`, shared
by many servers and standalone workers). What differs is in `database` (connection pragmas
and `BEGIN IMMEDIATE` on SQLite; REPEATABLE READ reads on PostgreSQL), `dialect` and
`records` (`FOR UPDATE`, advisory locks and upserts, which the rules take on PostgreSQL where
SQLite's write lock serialises everything), `schema` (foreign keys off during SQLite's
migrations; an advisory lock on PostgreSQL), `notify` and `feed` (PostgreSQL's trigger
announcing committed events, and LISTEN; SQLite's `PRAGMA data_version`) and `backup`
(SQLite's backup API, SQLite only).
"""

from .database import Database

__all__ = ["Database"]
