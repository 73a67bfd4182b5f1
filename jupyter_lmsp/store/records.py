"""Rows as table models, on a SQLAlchemy Core connection: the small helpers the store's
look-ups share (`queries`, `clients`, `idempotency`, `runners`, `models`).

The store's one SQL style is Core statements executed on the `Connection` that
`Database.writing()` / `Database.reading()` yield. Callers still get the table models of
`tables` (`Task`, `Client`, ...), built from the rows (`Model(**row._mapping)`), detached:
nothing is loaded later, so they stay readable after the transaction ends.

A row a rule creates on the hot path (a response and its task, `new_record`) is a plain record
with the table model's attributes and defaults instead: building the two table models cost
~140 µs of a background create's ~3.5 ms of server CPU (instrumented attributes), and nothing
after reads them as anything but attributes (`column_values` gives their rows' values).

Statements are built once per table (`by_key`) and SQLAlchemy caches their compiled form.
The hot inserts (a create's rows, a commit's events: `insert_rows`) go one step further: their
Core `insert` is compiled once per dialect and columns, and its parameters go to the driver as
they are (`Connection.exec_driver_sql`), skipping SQLAlchemy's per-execution work.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import cache, lru_cache
from types import SimpleNamespace
from typing import Any, TypeVar

from sqlalchemy import Select, Table, Update, and_, bindparam, func, insert, select, update
from sqlalchemy.engine import Connection, Dialect, Row
from sqlmodel import SQLModel

from .dialect import insert_of

M = TypeVar("M", bound=SQLModel)


def table(model: type[SQLModel]) -> Table:
    return model.__table__  # type: ignore[attr-defined]


@cache
def _columns(model: type[SQLModel]) -> tuple[tuple[str, ...], dict[str, Any], frozenset[str]]:
    # The table's column names; the static defaults of the fields that have one; the names of
    # the fields with neither a default nor a default factory (required, as the model has them).
    names = tuple(c.name for c in table(model).columns)
    defaults: dict[str, Any] = {}
    required = set()
    for name in names:
        field = model.model_fields[name]
        if field.default_factory is not None:
            continue
        if field.is_required():
            required.add(name)
        else:
            defaults[name] = field.default
    return names, defaults, frozenset(required)


def new_record(model: type[M], /, **values: Any) -> M:
    """A new row of `model`'s table as a record (`SimpleNamespace`): every column, each the
    value given or the field's default, like `model(**values)` without the table model's
    instrumentation. An unknown name or a missing required one is a TypeError, as there.
    (`model` is positional only: tasks and responses have a column of that name.)"""
    names, defaults, required = _columns(model)
    unknown = values.keys() - set(names)
    if unknown:
        raise TypeError(f"{model.__name__} has no column {', '.join(sorted(unknown))}")
    missing = required - values.keys()
    if missing:
        raise TypeError(f"{model.__name__} needs {', '.join(sorted(missing))}")
    row = dict(defaults)
    for name in names:
        if name not in row and name not in values:
            factory = model.model_fields[name].default_factory
            row[name] = factory() if factory is not None else None  # type: ignore[call-arg]
    row.update(values)
    return SimpleNamespace(**row)  # type: ignore[return-value]


def column_values(row: Any, model: type[SQLModel]) -> dict[str, Any]:
    """The values of every column of `model`'s table in `row` (a table model or a record)."""
    return {name: getattr(row, name) for name in _columns(model)[0]}


@cache
def by_key(model: type[SQLModel]) -> Select[Any]:
    """`SELECT * FROM <table> WHERE <primary key> = :<key column>...`, built once."""
    t = table(model)
    return select(t).where(and_(*(col == bindparam(col.name) for col in t.primary_key)))


@cache
def _update_by_key(model: type[SQLModel]) -> Update:
    # The SET clause comes from the parameters given (those named as columns); the key's
    # parameters are named apart, so they never become part of it.
    t = table(model)
    return update(t).where(and_(*(col == bindparam(f"key_{col.name}") for col in t.primary_key)))


def save(conn: Connection, row: SQLModel) -> int:
    """Write every column of `row` to the stored row with its primary key; how many rows
    changed (0: there is none)."""
    t = table(type(row))
    values = row.model_dump()
    keys = {c.name for c in t.primary_key}
    params = {name: value for name, value in values.items() if name not in keys}
    params.update({f"key_{name}": values[name] for name in keys})
    return int(conn.execute(_update_by_key(type(row)), params).rowcount)


def insert_rows(conn: Connection, t: Table, rows: list[dict[str, Any]]) -> None:
    """`INSERT` the `rows` (dictionaries with the same keys, column names) into `t`.

    The Core statement is compiled once per dialect and set of columns, and executed with the
    rows' values, each converted by its column type's `bind_processor` as SQLAlchemy would,
    on the same connection and transaction (`exec_driver_sql`): SQLAlchemy's own work per
    execution of a Core `insert` (its compiled-cache look-up, the parameters processed through
    generic machinery, the result set up) costs 15-30 µs a statement here, and a background
    create inserts three rows before its 202. A column left out must have no default computed
    here (else the rows go through `conn.execute(insert(t), rows)`, which is what this does)."""
    if not rows:
        return
    compiled = _compiled_insert(t, tuple(rows[0]), conn.dialect)
    if compiled is None:
        conn.execute(insert(t), rows)
        return
    sql, names, processors, positional = compiled
    params: list[Any] = []
    for row in rows:
        values = [
            row[name] if process is None else process(row[name])
            for name, process in zip(names, processors, strict=True)
        ]
        params.append(tuple(values) if positional else dict(zip(names, values, strict=True)))
    conn.exec_driver_sql(sql, params if len(params) > 1 else params[0])


Processor = Callable[[Any], Any] | None


@lru_cache(maxsize=64)
def _compiled_insert(
    t: Table, keys: tuple[str, ...], dialect: Dialect
) -> tuple[str, tuple[str, ...], tuple[Processor, ...], bool] | None:
    """`INSERT INTO t (keys...)` in `dialect`: its SQL, its parameters' names in order, each
    one's conversion, and whether they are positional; None when it needs more than that."""
    if not set(keys) <= set(t.c.keys()):
        return None
    compiled = insert(t).compile(dialect=dialect, column_keys=list(keys))
    # A column left out but with a default computed here would add a parameter of its own.
    if set(compiled.binds) != set(keys):
        return None
    names = tuple(compiled.positiontup or ()) if compiled.positional else keys
    processors = tuple(t.c[name].type.bind_processor(dialect) for name in names)
    return compiled.string, names, processors, compiled.positional


class DriverStatement:
    """A Core statement compiled once for a dialect, run on the driver's own connection: its
    SQL and its parameters (the statement's own values, then the caller's) in the driver's
    style. For a thread that runs one or two statements many times a second on a connection
    of its own (the feed's watch, 50 times a second): SQLAlchemy's execution path touches ten
    times the code of the driver's, and on a busy machine each wake-up pays for it in cache
    misses (issue 41: the feed's CPU per token of a slow model, 0.11 -> 0.17 ms). Only for
    statements whose parameters need no type conversion (strings, numbers): checked here."""

    def __init__(self, statement: Any, dialect: Dialect) -> None:
        compiled = statement.compile(dialect=dialect)
        for bind in compiled.binds.values():
            if bind.type.bind_processor(dialect) is not None:
                raise TypeError(f"parameter {bind.key!r} needs its type's conversion")
        self.sql = compiled.string
        self.defaults = dict(compiled.params)
        self.order = tuple(compiled.positiontup or ()) if compiled.positional else None

    def params(self, given: dict[str, Any]) -> Any:
        values = {**self.defaults, **given}
        return values if self.order is None else tuple(values[name] for name in self.order)

    def rows(self, driver: Any, given: dict[str, Any]) -> list[Any]:
        """Its rows, run on a DB-API connection (`Connection.connection.driver_connection`)."""
        cursor = driver.cursor()
        try:
            cursor.execute(self.sql, self.params(given))
            return list(cursor.fetchall())
        finally:
            cursor.close()


def record(model: type[M], row: Row[Any]) -> M:
    """A table model built from a row of its table."""
    return model(**row._mapping)


def get(conn: Connection, model: type[M], *key: Any, for_update: bool = False) -> M | None:
    """The row of `model`'s table with this primary key (in the key's column order), or None.
    `for_update` locks it until the transaction ends (PostgreSQL; nothing on SQLite, whose
    write transactions hold the one write lock already)."""
    t = table(model)
    statement = by_key(model)
    if for_update:
        statement = statement.with_for_update()
    row = conn.execute(
        statement, dict(zip((c.name for c in t.primary_key), key, strict=True))
    ).first()
    return None if row is None else record(model, row)


def records(model: type[M], rows: Iterable[Row[Any]]) -> list[M]:
    return [model(**row._mapping) for row in rows]


def upsert(conn: Connection, row: SQLModel) -> None:
    """Insert `row`, or replace the stored row with its primary key (one statement: `INSERT ...
    ON CONFLICT DO UPDATE`, in the backend's own dialect)."""
    t = table(type(row))
    values = row.model_dump()
    keys = [c.name for c in t.primary_key]
    statement = insert_of(conn.dialect.name)(t).values(values)
    conn.execute(
        statement.on_conflict_do_update(
            index_elements=keys,
            set_={name: statement.excluded[name] for name in values if name not in keys},
        )
    )


def advisory_lock(conn: Connection, name: str) -> None:
    """Hold a lock on `name` until the transaction ends, on PostgreSQL (on SQLite the write
    transaction already excludes every other writer). For rows that may not exist yet."""
    if conn.dialect.name == "postgresql":
        conn.execute(select(func.pg_advisory_xact_lock(func.hashtext(name))))
