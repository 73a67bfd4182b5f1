"""Persistence (LMSP section 11): SQLModel tables on SQLite, and the section 11 rules as transactions.

`tables` defines the tables of 11.1 (and `pairings`, `runners`), `database` opens SQLite the
way the rules need it (WAL, busy timeout, write transactions that take the lock up front),
`schema` versions it (Alembic migrations in `migrations/`), `rules` holds one transactional
function per rule of 11.2 and 11.3, `runners` the leases of the processes that drive tasks,
`queries` the read-only look-ups, `backup` online copies.

Two backends: SQLite (the embedded default) and PostgreSQL (`postgresql+psycopg://`, shared
by many servers and standalone workers). What differs is in `database` (connection pragmas
and `BEGIN IMMEDIATE` on SQLite; REPEATABLE READ reads on PostgreSQL), `dialect` (the DB-API
cursor of the plain-SQL hot paths, in SQLite's parameter style on both; `FOR UPDATE` and
advisory locks, which the rules take on PostgreSQL where SQLite's write lock serialises
everything), `schema` (foreign keys off during SQLite's migrations; an advisory lock on
PostgreSQL), `notify` (PostgreSQL's trigger announcing committed events) and `backup`
(SQLite's backup API, SQLite only). Everything else goes through SQLAlchemy.
"""

from .database import Database

__all__ = ["Database"]
