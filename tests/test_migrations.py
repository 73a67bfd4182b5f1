"""Schema migrations (Alembic): versioned schema, upgrades with a backup first, refusals.

What these tests prove:

- the migrations, applied in order to an empty database, give exactly the schema of the table
  models (Alembic's autogenerate comparison finds nothing, and reflecting both databases gives
  the same columns, indexes, unique constraints and foreign keys with their options);
- `schema.HEAD` is the newest migration;
- a database written by release 0.1.0 (its schema frozen below as 0.1.0's `create_all` made
  it, its rows made by the rule functions and copied in) is upgraded when opened: a copy of it
  as it was lies beside it, and every task, event, response, model, client, pairing, key and
  configuration row is still there, equal column by column, the one user's rows now owned by
  the upgrading server's user; the upgraded database passes SQLite's integrity and
  foreign-key checks, and start-up recovery then works on it;
- an upgrade that fails leaves the database exactly as it was; two processes opening an old
  database at once upgrade it once;
- a database of a newer revision, or one that is not an LMSP database, is refused with a
  message that says so;
- the foreign keys are real: an event without its task is refused, deleting a task deletes
  its events, deleting a runner frees its tasks.
"""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import pytest
import sqlalchemy.exc
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from legacydb import (
    LEGACY_OWNER,
    NEW_OWNER,
    OWNER_COLUMN,
    V010_TABLES,
    release_0_1_0_database,
)
from sqlalchemy import bindparam, create_engine, delete, func, insert, inspect, select
from sqlmodel import SQLModel
from storehelpers import POLICIES, UNFINISHED, check_log, make_task, open_db

from jupyter_lmsp.store import backup, rules, schema
from jupyter_lmsp.store.database import Database, sqlite_url
from jupyter_lmsp.store.records import table as table_of
from jupyter_lmsp.store.tables import Response, Task, TaskEvent

_TASKS, _RESPONSES, _EVENTS = (table_of(m) for m in (Task, Response, TaskEvent))
_EVENTS_OF = (
    select(func.count()).select_from(_EVENTS).where(_EVENTS.c.task_id == bindparam("task_id"))
)

# ---------------------------------------------------------------------------------------------
# helpers


def _plain(path: Path) -> sqlite3.Connection:
    return sqlite3.connect(path, isolation_level=None)


def _rows(path: Path, table: str, columns: list[str]) -> list[tuple]:
    conn = _plain(path)
    try:
        quoted = ", ".join(f'"{c}"' for c in columns)
        return [tuple(r) for r in conn.execute(f"SELECT {quoted} FROM {table} ORDER BY 1, 2")]
    finally:
        conn.close()


def _migrated_from_empty(path: Path) -> None:
    """Apply every migration, in order, to an empty database file."""
    engine = create_engine(sqlite_url(path))
    try:
        with engine.connect() as conn:
            conn.connection.dbapi_connection.execute("PRAGMA foreign_keys=OFF")
            with conn.begin():
                schema.run_migrations(conn, "head", legacy_owner=NEW_OWNER)
    finally:
        engine.dispose()


def _created_from_models(path: Path) -> None:
    engine = create_engine(sqlite_url(path))
    try:
        SQLModel.metadata.create_all(engine)
    finally:
        engine.dispose()


def _reflect(path: Path | str) -> dict:
    """Everything SQLAlchemy reflects of a database's tables (a SQLite file, or a URL), in a
    comparable form."""
    engine = create_engine(path if isinstance(path, str) else sqlite_url(path))
    try:
        insp = inspect(engine)
        out = {}
        for table in sorted(insp.get_table_names()):
            if table == schema.VERSION_TABLE:
                continue
            out[table] = {
                "columns": [
                    (c["name"], str(c["type"]), c["nullable"], c.get("default"))
                    for c in insp.get_columns(table)
                ],
                "pk": insp.get_pk_constraint(table)["constrained_columns"],
                "indexes": sorted(
                    (i["name"], tuple(i["column_names"]), bool(i["unique"]))
                    for i in insp.get_indexes(table)
                ),
                "unique": sorted(
                    tuple(u["column_names"]) for u in insp.get_unique_constraints(table)
                ),
                "foreign_keys": sorted(
                    (
                        fk["name"],
                        tuple(fk["constrained_columns"]),
                        fk["referred_table"],
                        tuple(fk["referred_columns"]),
                        tuple(sorted((fk.get("options") or {}).items())),
                    )
                    for fk in insp.get_foreign_keys(table)
                ),
            }
        return out
    finally:
        engine.dispose()


def _sqlite_fk_options(path: Path) -> dict:
    """What SQLite itself says of every foreign key (ON DELETE, and DEFERRABLE from the SQL)."""
    conn = _plain(path)
    try:
        out = {}
        for (table,) in conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name != ?",
            (schema.VERSION_TABLE,),
        ):
            for _id, _seq, parent, column, to, _on_update, on_delete, _match in conn.execute(
                f"PRAGMA foreign_key_list('{table}')"
            ):
                out[(table, column)] = (parent, to, on_delete)
            sql = conn.execute(
                "SELECT sql FROM sqlite_master WHERE type = 'table' AND name = ?", (table,)
            ).fetchone()[0]
            out[(table, "deferred")] = sql.count("DEFERRABLE INITIALLY DEFERRED")
        return out
    finally:
        conn.close()


# ---------------------------------------------------------------------------------------------
# the migrations give the models' schema


def test_head_is_the_newest_migration():
    script = ScriptDirectory.from_config(schema.alembic_config())
    assert script.get_current_head() == schema.HEAD
    assert len(script.get_heads()) == 1  # one line of history, no branches
    assert schema.known_revisions() >= {schema.RELEASE_0_1_0, schema.HEAD}


def test_migrations_applied_to_an_empty_database_equal_the_models(tmp_path):
    migrated, modelled = tmp_path / "migrated.sqlite", tmp_path / "modelled.sqlite"
    _migrated_from_empty(migrated)
    _created_from_models(modelled)

    engine = create_engine(sqlite_url(migrated))
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={"compare_type": True})
            differences = compare_metadata(context, SQLModel.metadata)
    finally:
        engine.dispose()
    assert differences == [], differences

    # Reflected in full, with what autogenerate does not compare (foreign-key options).
    assert _reflect(migrated) == _reflect(modelled)
    assert _sqlite_fk_options(migrated) == _sqlite_fk_options(modelled)


def test_migrations_applied_to_an_empty_postgresql_database_equal_the_models(pg_url, pg_cluster):
    """The same on PostgreSQL: the migrations run there (their SQLite-only table rebuilds are
    plain ALTERs on PostgreSQL) and give the models' schema, foreign-key options included."""
    migrated, modelled = pg_url, pg_cluster.new_database()
    engine = create_engine(migrated)
    try:
        with engine.begin() as conn:
            schema.run_migrations(conn, "head", legacy_owner=NEW_OWNER)
        with engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={"compare_type": True})
            differences = compare_metadata(context, SQLModel.metadata)
    finally:
        engine.dispose()
    assert differences == [], differences
    engine = create_engine(modelled)
    try:
        with engine.begin() as conn:
            schema.create_all(conn)
        with engine.connect() as conn:
            deferrable = conn.exec_driver_sql(
                "SELECT conname, condeferrable, condeferred, confdeltype FROM pg_constraint"
                " WHERE contype = 'f' ORDER BY conname"
            ).fetchall()
    finally:
        engine.dispose()
    assert _reflect(migrated) == _reflect(modelled)
    engine = create_engine(migrated)
    try:
        with engine.connect() as conn:
            assert (
                conn.exec_driver_sql(
                    "SELECT conname, condeferrable, condeferred, confdeltype FROM pg_constraint"
                    " WHERE contype = 'f' ORDER BY conname"
                ).fetchall()
                == deferrable
            )
    finally:
        engine.dispose()
    assert len(deferrable) == 9 and sum(1 for row in deferrable if row[1] and row[2]) == 2
    # The trigger announcing committed events (store.notify) is made both ways too.
    for url in (migrated, modelled):
        engine = create_engine(url)
        try:
            with engine.connect() as conn:
                triggers = conn.exec_driver_sql(
                    "SELECT tgname FROM pg_trigger WHERE NOT tgisinternal"
                ).fetchall()
        finally:
            engine.dispose()
        assert triggers == [("lmsp_task_events_notify",)], url


def test_a_new_postgresql_database_is_created_at_the_newest_revision(pg_url):
    db = Database(pg_url)
    try:
        assert db.schema.status.revision == schema.HEAD and db.schema.backup is None
        assert db.is_postgres
    finally:
        db.dispose()
    again = Database(pg_url)  # opened again: left as it is
    try:
        assert again.schema.status.state == "current" and again.schema.upgraded_from is None
    finally:
        again.dispose()


def test_a_new_database_is_created_at_the_newest_revision(tmp_path):
    db = open_db(tmp_path)
    try:
        assert db.schema.status.revision == schema.HEAD and db.schema.backup is None
    finally:
        db.dispose()
    conn = _plain(tmp_path / "lmsp.sqlite")
    assert conn.execute("SELECT version_num FROM alembic_version").fetchall() == [(schema.HEAD,)]
    conn.close()
    assert list(tmp_path.glob("*.backup-*")) == []  # nothing to back up


# ---------------------------------------------------------------------------------------------
# a database of release 0.1.0


def test_a_release_0_1_0_database_is_upgraded_with_nothing_lost(tmp_path):
    path = tmp_path / "lmsp.sqlite"
    release_0_1_0_database(path, tmp_path)
    before = {t: _rows(path, t, cols) for t, cols in V010_TABLES.items()}
    assert len(before["tasks"]) == 23 and len(before["task_events"]) > 100

    db = Database(sqlite_url(path), legacy_owner=NEW_OWNER)
    try:
        assert db.schema.upgraded_from == schema.RELEASE_0_1_0
        assert db.schema.status.revision == schema.HEAD

        # Every row of every table, every column 0.1.0 had, is still there; only the one
        # user's name changed hands.
        for table, columns in V010_TABLES.items():
            after = _rows(path, table, columns)
            expected = before[table]
            if table in OWNER_COLUMN:
                at = columns.index(OWNER_COLUMN[table])
                expected = sorted(
                    tuple(
                        NEW_OWNER if i == at and v == LEGACY_OWNER else v for i, v in enumerate(r)
                    )
                    for r in expected
                )
                after = sorted(after)
            assert after == expected, table
        conn = _plain(path)
        # Clients and decided pairings are the upgrading user's; the pending pairing nobody's.
        assert conn.execute("SELECT id, paired_by FROM clients ORDER BY id").fetchall() == [
            ("client_1", NEW_OWNER),
            ("client_2", NEW_OWNER),
        ]
        assert conn.execute("SELECT id, decided_by FROM pairings ORDER BY id").fetchall() == [
            ("pair_1", NEW_OWNER),
            ("pair_2", None),
        ]
        # ... who approved them, for revocation; the models are not the service's to delete.
        assert conn.execute("SELECT id, approved_by FROM clients ORDER BY id").fetchall() == [
            ("client_1", NEW_OWNER),
            ("client_2", NEW_OWNER),
        ]
        assert conn.execute("SELECT id, managed FROM models").fetchall() == [("tiny", 0)]
        assert conn.execute(
            "SELECT count(*) FROM tasks WHERE runner_id IS NOT NULL"
        ).fetchone() == (0,)
        conn.close()
        assert backup.integrity(path) == []

        # The copy taken first is the database as 0.1.0 left it.
        (copy,) = tmp_path.glob("lmsp.sqlite.backup-0001-*")
        assert copy == db.schema.backup
        for table, columns in V010_TABLES.items():
            assert _rows(copy, table, columns) == before[table], table
        conn = _plain(copy)
        assert "alembic_version" not in {
            r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
        }
        conn.close()

        # And the service works on it: start-up recovery applies the 11.3 table.
        report = rules.recover_at_startup(db)
        assert report.examined == len(UNFINISHED) * len(POLICIES) + 1  # + the queued resume
        for (task_id,) in _plain(path).execute("SELECT id FROM tasks"):
            check_log(db, task_id)
    finally:
        db.dispose()

    # Opening it again changes nothing and takes no second copy.
    again = Database(sqlite_url(path), legacy_owner="jupyter:someone-else")
    again.dispose()
    assert len(list(tmp_path.glob("lmsp.sqlite.backup-*"))) == 1
    assert ("jupyter:someone-else",) not in _plain(path).execute("SELECT owner FROM tasks")


def test_an_upgrade_that_fails_leaves_the_database_as_it_was(tmp_path, monkeypatch):
    path = tmp_path / "lmsp.sqlite"
    release_0_1_0_database(path, tmp_path)
    before = {t: _rows(path, t, cols) for t, cols in V010_TABLES.items()}
    sql_before = _plain(path).execute("SELECT sql FROM sqlite_master ORDER BY name").fetchall()

    real = schema.run_migrations

    def failing(connection, target, **attributes):
        real(connection, target, **attributes)  # every change is made...
        raise RuntimeError("injected failure")  # ...and then the upgrade fails

    monkeypatch.setattr(schema, "run_migrations", failing)
    with pytest.raises(RuntimeError, match="injected failure"):
        Database(sqlite_url(path), legacy_owner=NEW_OWNER)
    assert _plain(path).execute("SELECT sql FROM sqlite_master ORDER BY name").fetchall() == (
        sql_before
    )
    for table, columns in V010_TABLES.items():
        assert _rows(path, table, columns) == before[table], table

    monkeypatch.setattr(schema, "run_migrations", real)
    db = Database(sqlite_url(path), legacy_owner=NEW_OWNER)
    assert db.schema.upgraded_from == schema.RELEASE_0_1_0
    db.dispose()


def test_two_processes_opening_an_old_database_at_once_upgrade_it_once(tmp_path):
    path = tmp_path / "lmsp.sqlite"
    release_0_1_0_database(path, tmp_path)
    results: list = []
    barrier = threading.Barrier(2)

    def open_it() -> None:
        barrier.wait()
        db = Database(sqlite_url(path), legacy_owner=NEW_OWNER)
        results.append(db.schema)
        db.dispose()

    threads = [threading.Thread(target=open_it) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r.upgraded_from or "-" for r in results) == ["-", schema.RELEASE_0_1_0]
    assert len(list(tmp_path.glob("lmsp.sqlite.backup-*"))) == 1


# ---------------------------------------------------------------------------------------------
# refusals


def test_a_database_of_a_newer_revision_is_refused(tmp_path):
    db = open_db(tmp_path)
    db.dispose()
    conn = _plain(tmp_path / "lmsp.sqlite")
    conn.execute("UPDATE alembic_version SET version_num = '9999'")
    conn.close()
    with pytest.raises(schema.SchemaTooNew) as caught:
        open_db(tmp_path)
    message = str(caught.value)
    assert "9999" in message and "newer jupyter-lmsp" in message and schema.HEAD in message
    # Nothing was touched: the revision is still the newer one.
    assert _plain(tmp_path / "lmsp.sqlite").execute(
        "SELECT version_num FROM alembic_version"
    ).fetchall() == [("9999",)]


def test_a_database_that_is_not_an_lmsp_database_is_refused(tmp_path):
    conn = _plain(tmp_path / "lmsp.sqlite")
    conn.execute("CREATE TABLE something_else (x)")
    conn.close()
    with pytest.raises(schema.SchemaError, match="not an LMSP database"):
        open_db(tmp_path)


def test_doctor_mode_leaves_an_old_database_alone(tmp_path):
    path = tmp_path / "lmsp.sqlite"
    release_0_1_0_database(path, tmp_path)
    db = Database(sqlite_url(path), upgrade=False)
    try:
        assert db.schema.status.state == "old"
        assert db.schema.status.revision == schema.RELEASE_0_1_0
    finally:
        db.dispose()
    assert list(tmp_path.glob("lmsp.sqlite.backup-*")) == []
    assert "alembic_version" not in {
        r[0] for r in _plain(path).execute("SELECT name FROM sqlite_master WHERE type = 'table'")
    }


# ---------------------------------------------------------------------------------------------
# the foreign keys are real


def test_foreign_keys_are_enforced(tmp_path):
    db = open_db(tmp_path)
    try:
        task_id = make_task(db, "completed")
        with db.writing() as conn:
            events = conn.execute(_EVENTS_OF, {"task_id": task_id}).scalar_one()
        assert events > 3
        # An event for a task that does not exist is refused.
        with pytest.raises(sqlalchemy.exc.IntegrityError), db.writing() as conn:
            conn.execute(
                insert(_EVENTS),
                {
                    "task_id": "task_nope",
                    "sequence_number": 0,
                    "type": "x",
                    "data": "{}",
                    "created_at": 0,
                },
            )
        # A response and its task go together: deleting only the task breaks a deferred key,
        # which fails at commit.
        with pytest.raises(sqlalchemy.exc.IntegrityError), db.writing() as conn:
            conn.execute(delete(_TASKS).where(_TASKS.c.id == task_id))
        # Deleting both deletes the task's events with them.
        with db.writing() as conn:
            conn.execute(delete(_RESPONSES).where(_RESPONSES.c.task_id == task_id))
            conn.execute(delete(_TASKS).where(_TASKS.c.id == task_id))
        with db.writing() as conn:
            left = conn.execute(_EVENTS_OF, {"task_id": task_id}).scalar_one()
        assert left == 0
    finally:
        db.dispose()


def test_doctor_mode_makes_nothing_in_an_empty_database(tmp_path):
    path = tmp_path / "lmsp.sqlite"
    path.touch()
    db = Database(sqlite_url(path), upgrade=False)
    db.dispose()
    assert db.schema.status.state == "empty"
    assert _plain(path).execute("SELECT count(*) FROM sqlite_master").fetchone() == (0,)
