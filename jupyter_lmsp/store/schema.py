"""The database's schema version: create it, recognise it, upgrade it, or refuse it.

Opening a database (`Database(...)`) calls `prepare`, inside one `BEGIN IMMEDIATE`
transaction, so that several servers starting together on one file take turns:

- an empty database gets the current schema from the table models (`tables.py`) and is
  stamped with the newest revision (tests/test_migrations.py checks that the migrations,
  applied in order, give the very same schema);
- a database at the newest revision is left as it is;
- an older one (an earlier revision, or a database of release 0.1.0, which had no version
  table) is first copied beside itself with SQLite's backup API
  (`lmsp.sqlite.backup-<revision>-<time>`), then upgraded by the Alembic migrations in
  `store/migrations/versions`, all of them in the one transaction, with foreign keys checked
  before it commits;
- a database of a newer revision than this code knows is refused with `SchemaTooNew`.

Migrations run with `PRAGMA foreign_keys=OFF` (a table rebuild drops the old table, which
would otherwise cascade) and end with `PRAGMA foreign_key_check`.

On PostgreSQL the same steps run in one transaction holding an advisory lock (servers starting
together take turns, and PostgreSQL's DDL is transactional); its foreign keys are enforced by
the DDL itself, and no file copy is taken before an upgrade (`pg_dump` is the tool for that).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import inspect, text
from sqlalchemy.engine import Connection, Engine
from sqlmodel import SQLModel

from . import tables  # noqa: F401  (registers the tables on SQLModel.metadata)

log = logging.getLogger(__name__)

# The newest revision in store/migrations/versions (a test keeps the two equal). Kept here so
# that opening a current database needs no Alembic at all.
HEAD = "0008"
# The revision a database of release 0.1.0 (no version table) is at.
RELEASE_0_1_0 = "0001"
RELEASE_0_1_0_TABLES = frozenset(
    {
        "service_config",
        "clients",
        "pairings",
        "models",
        "responses",
        "tasks",
        "task_events",
        "idempotency_keys",
    }
)
VERSION_TABLE = "alembic_version"
# The PostgreSQL advisory lock servers take turns on to prepare the schema ("LMSP" in ASCII).
SCHEMA_LOCK = 0x4C4D5350


class SchemaError(RuntimeError):
    """The database cannot be used by this version of jupyter-lmsp (the message says why)."""


class SchemaTooNew(SchemaError):
    pass


@dataclass
class SchemaStatus:
    """Where a database stands: `revision` (None when empty) against `HEAD`."""

    revision: str | None
    state: str  # "empty" | "current" | "old" | "newer" | "foreign"
    head: str = HEAD

    @property
    def describe(self) -> str:
        match self.state:
            case "empty":
                return "empty (the schema is created on first use)"
            case "current":
                return f"revision {self.revision} (current)"
            case "old":
                return f"revision {self.revision}, older than {self.head}: upgraded at start-up"
            case "newer":
                return f"revision {self.revision}, newer than this jupyter-lmsp knows ({self.head})"
        return "not an LMSP database"


@dataclass
class Prepared:
    status: SchemaStatus
    upgraded_from: str | None = None
    backup: Path | None = None


def status(connection: Connection) -> SchemaStatus:
    names = set(inspect(connection).get_table_names())
    if VERSION_TABLE in names:
        revision = connection.execute(text(f"SELECT version_num FROM {VERSION_TABLE}")).scalar()
        if revision == HEAD:
            return SchemaStatus(revision, "current")
        if revision in known_revisions():
            return SchemaStatus(revision, "old")
        return SchemaStatus(revision, "newer")
    if not names:
        return SchemaStatus(None, "empty")
    if names >= RELEASE_0_1_0_TABLES:
        return SchemaStatus(RELEASE_0_1_0, "old")
    return SchemaStatus(None, "foreign")


def prepare(
    engine: Engine,
    path: Path | None,
    *,
    upgrade: bool = True,
    legacy_owner: str | None = None,
) -> Prepared:
    """Bring the database behind `engine` to the current schema (see the module docstring).

    With `upgrade` False an old or empty database is left alone (`jupyter lmsp doctor`
    reports it).
    `path` is the database file (None in memory), beside which the backup goes.
    `legacy_owner` is who gets the rows release 0.1.0 wrote for its one user.
    """
    if engine.dialect.name == "postgresql":
        with engine.begin() as connection:
            connection.exec_driver_sql(f"SELECT pg_advisory_xact_lock({SCHEMA_LOCK})")
            return _prepare(connection, None, upgrade, legacy_owner)
    with engine.connect() as connection:
        dbapi = connection.connection.dbapi_connection
        assert dbapi is not None
        dbapi.execute("PRAGMA foreign_keys=OFF")
        try:
            with connection.execution_options(lmsp_begin="IMMEDIATE").begin():
                return _prepare(connection, path, upgrade, legacy_owner)
        finally:
            dbapi.execute("PRAGMA foreign_keys=ON")


def _prepare(
    connection: Connection, path: Path | None, upgrade: bool, legacy_owner: str | None
) -> Prepared:
    found = status(connection)
    if found.state == "current":
        return Prepared(found)
    if found.state == "newer":
        raise SchemaTooNew(
            f"The database {path or ''} has schema revision {found.revision}, written by a "
            f"newer jupyter-lmsp than this one (which knows revisions up to {HEAD}). Upgrade "
            "jupyter-lmsp, or point LMSPExtension.data_dir at another folder."
        )
    if found.state == "foreign":
        raise SchemaError(
            f"{path or 'The database'} holds tables that are not an LMSP database's; "
            "point LMSPExtension.data_dir at another folder."
        )
    if found.state == "empty":
        if not upgrade:
            return Prepared(found)  # only looking (`jupyter lmsp doctor`): nothing is made
        create_all(connection)
        _stamp(connection, HEAD)
        return Prepared(SchemaStatus(HEAD, "current"))
    if not upgrade:
        return Prepared(found)
    backup_path = None
    if path is not None:
        from .backup import backup

        stamp = time.strftime("%Y%m%d-%H%M%S")
        backup_path = path.with_name(f"{path.name}.backup-{found.revision}-{stamp}")
        n = 1
        while backup_path.exists():  # an earlier attempt this second (that failed)
            n += 1
            backup_path = path.with_name(f"{path.name}.backup-{found.revision}-{stamp}-{n}")
        # The backup reads through a connection of its own: it sees the last commit, which is
        # what this transaction sees too (it has written nothing yet, and holds the write
        # lock, so nobody else can commit before the upgrade does).
        backup(path, backup_path)
        log.warning(
            "LMSP: upgrading the database %s from schema revision %s to %s; a copy of it as it "
            "was is at %s",
            path,
            found.revision,
            HEAD,
            backup_path,
        )
    if found.revision == RELEASE_0_1_0 and not _has_version_table(connection):
        _stamp(connection, RELEASE_0_1_0)
    run_migrations(connection, HEAD, legacy_owner=legacy_owner or _default_legacy_owner())
    if connection.dialect.name != "sqlite":
        return Prepared(SchemaStatus(HEAD, "current"), found.revision, backup_path)
    problems = connection.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
    if problems:
        raise SchemaError(f"The upgraded database breaks foreign keys: {problems[:5]}")
    return Prepared(SchemaStatus(HEAD, "current"), found.revision, backup_path)


def create_all(connection: Connection) -> None:
    """Create the tables of the models, leaving the models as they were.

    On a database that can alter tables (PostgreSQL), SQLAlchemy adds the foreign key declared
    `use_alter` (responses → tasks) by an ALTER after the tables and marks it, in the shared
    metadata, as never again to be written inside a CREATE TABLE: a SQLite database created
    later in the same process would then lack it. The marks are put back.
    """
    constraints = [
        c for table in SQLModel.metadata.tables.values() for c in table.foreign_key_constraints
    ]
    kept = [(c, c._create_rule) for c in constraints]
    try:
        SQLModel.metadata.create_all(connection)
    finally:
        for constraint, rule in kept:
            constraint._create_rule = rule


def run_migrations(connection: Connection, target: str, **attributes: Any) -> None:
    """Apply the migrations up to `target` on `connection`, in its current transaction."""
    from alembic import command

    config = alembic_config()
    config.attributes["connection"] = connection
    config.attributes.update(attributes)
    command.upgrade(config, target)


def alembic_config() -> Any:
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(Path(__file__).parent / "migrations"))
    return config


def known_revisions() -> set[str]:
    """Every revision the migrations know, oldest to newest."""
    from alembic.script import ScriptDirectory

    return {rev.revision for rev in ScriptDirectory.from_config(alembic_config()).walk_revisions()}


def _has_version_table(connection: Connection) -> bool:
    return VERSION_TABLE in inspect(connection).get_table_names()


def _stamp(connection: Connection, revision: str) -> None:
    connection.exec_driver_sql(
        f"CREATE TABLE IF NOT EXISTS {VERSION_TABLE} (version_num VARCHAR(32) NOT NULL,"
        f" CONSTRAINT {VERSION_TABLE}_pkc PRIMARY KEY (version_num))"
    )
    connection.exec_driver_sql(f"DELETE FROM {VERSION_TABLE}")
    connection.execute(text(f"INSERT INTO {VERSION_TABLE} VALUES (:v)"), {"v": revision})


def _default_legacy_owner() -> str:
    from ..auth.identity import server_owner

    return server_owner()
