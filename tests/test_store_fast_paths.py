"""The store's fast paths, on each backend: `records.insert_rows` (the same rows as a Core
`insert`, the column types' conversions applied, Core's own path where it cannot be skipped)
and `records.DriverStatement` (the same rows as Core's execution of the statement)."""

from __future__ import annotations

import pytest
from sqlalchemy import Float, bindparam, insert, select
from storehelpers import open_db

from jupyter_lmsp.store import records, rules
from jupyter_lmsp.store.rules.rows import EVENTS, RESPONSES, TASKS
from jupyter_lmsp.store.tables import Response, Task


@pytest.fixture
def db(db_url):
    database = open_db(db_url)
    yield database
    database.dispose()


def _task_values(task_id: str, **kw) -> dict:
    """A task's columns that have no default (and `kw`)."""
    values = dict(
        id=task_id,
        kind="response",
        state="queued",
        on_restart="resume",
        owner="owner",
        model="tiny",
        created_at=1.5,
        updated_at=2.5,
    )
    values.update(kw)
    return values


def _task(task_id: str, **kw) -> dict:
    return Task(**_task_values(task_id, **kw)).model_dump()


def _rows(db, table, key) -> list[dict]:
    with db.reading() as conn:
        return [dict(r._mapping) for r in conn.execute(select(table).order_by(key))]


def test_inserted_rows_read_back_as_a_core_insert_of_the_same_rows_does(db):
    fast = [_task("t1"), _task("t2", params='{"max_tokens": 3}', cache_key="k")]
    slow = [_task("t3"), _task("t4", params='{"max_tokens": 3}', cache_key="k")]
    with db.writing() as conn:
        records.insert_rows(conn, TASKS, fast)
        conn.execute(insert(TASKS), slow)
    got = _rows(db, TASKS, TASKS.c.id)
    assert [r["id"] for r in got] == ["t1", "t2", "t3", "t4"]
    for a, b in zip(got[:2], got[2:], strict=True):
        assert {**a, "id": None} == {**b, "id": None}
        assert type(a["created_at"]) is float


def test_column_types_convert_the_values_on_the_way_in(db):
    # An int for a Float column, a bool for a Boolean one: converted as Core converts them.
    response = Response(
        id="r1", task_id="t1", owner="owner", model="tiny", request="{}", created_at=3
    ).model_dump()
    response["store"] = False
    with db.writing() as conn:
        records.insert_rows(conn, TASKS, [_task("t1", created_at=7)])
        records.insert_rows(conn, RESPONSES, [response])
    (task,) = _rows(db, TASKS, TASKS.c.id)
    (stored,) = _rows(db, RESPONSES, RESPONSES.c.id)
    assert task["created_at"] == 7.0 and type(task["created_at"]) is float
    assert stored["store"] is False and stored["created_at"] == 3.0


def test_one_row_and_many_rows_and_none(db):
    with db.writing() as conn:
        records.insert_rows(conn, TASKS, [_task("t1")])
        records.insert_rows(conn, TASKS, [])
        records.insert_rows(
            conn,
            EVENTS,
            [
                {
                    "task_id": "t1",
                    "sequence_number": i,
                    "type": "x",
                    "data": "{}",
                    "created_at": 1.0,
                }
                for i in range(3)
            ],
        )
    events = _rows(db, EVENTS, EVENTS.c.sequence_number)
    # The id column, left out, is the database's to give.
    assert [(e["sequence_number"], e["id"] is not None) for e in events] == [
        (0, True),
        (1, True),
        (2, True),
    ]


def test_a_key_that_names_no_column_takes_core_s_path(db):
    # Not compiled for the driver (it would be handed a value for no column): Core's insert
    # of a list of rows takes the columns' values and leaves the rest, as it always did.
    row = {**_task("t1"), "nope": 1}
    with db.writing() as conn:
        assert records._compiled_insert(TASKS, tuple(row), conn.dialect) is None
        records.insert_rows(conn, TASKS, [row])
    (got,) = _rows(db, TASKS, TASKS.c.id)
    assert got == _task("t1")


def test_a_failing_insert_rolls_back_with_its_transaction(db):
    with pytest.raises(Exception) as raised, db.writing() as conn:
        records.insert_rows(conn, TASKS, [_task("t1")])
        records.insert_rows(conn, TASKS, [_task("t1")])  # the same primary key
    assert "t1" in str(raised.value) or "UNIQUE" in str(raised.value).upper()
    assert _rows(db, TASKS, TASKS.c.id) == []


def test_a_driver_statement_reads_what_core_reads(db):
    with db.writing() as conn:
        records.insert_rows(
            conn,
            TASKS,
            [_task("t1", state="cancelling"), _task("t2", state="cancelling"), _task("t3")],
        )
    # A parameter of the caller's and one of the statement's own (the state).
    statement = (
        select(TASKS.c.id)
        .where(TASKS.c.owner == bindparam("owner"), TASKS.c.state == "cancelling")
        .order_by(TASKS.c.id)
    )
    with db.reading() as conn:
        core = [tuple(r) for r in conn.execute(statement, {"owner": "owner"})]
        driver = conn.connection.driver_connection
        fast = records.DriverStatement(statement, conn.dialect)
        got = [tuple(r) for r in fast.rows(driver, {"owner": "owner"})]
        assert fast.rows(driver, {"owner": "nobody"}) == []
    assert got == core == [("t1",), ("t2",)]


def test_a_driver_statement_refuses_parameters_that_need_converting(db):
    statement = select(TASKS.c.id).where(TASKS.c.created_at > bindparam("after", type_=Float))
    with pytest.raises(TypeError, match="after"):
        records.DriverStatement(statement, db.engine.dialect)


# The columns each table model needs (no default), for a new record of it.
REQUIRED = {
    Task: _task_values("t"),
    Response: dict(id="r", task_id="t", owner="o", model="m", request="{}", created_at=1.5),
}


@pytest.mark.parametrize("model", [Task, Response])
def test_a_new_record_has_the_table_models_columns_and_defaults(model):
    given = REQUIRED[model]
    record = records.new_record(model, **given)
    assert records.column_values(record, model) == model(**given).model_dump()
    # Every column, and nothing else.
    assert set(vars(record)) == {c.name for c in records.table(model).columns}
    with pytest.raises(TypeError, match="no column colour"):
        records.new_record(model, colour="red", **given)
    with pytest.raises(TypeError, match="needs owner"):
        records.new_record(model, **{k: v for k, v in given.items() if k != "owner"})


def test_a_created_task_from_records_reads_back_as_from_table_models(db):
    made = []
    for build in (records.new_record, lambda m, **kw: m(**kw)):
        n = len(made)
        response = build(
            Response,
            id=f"resp_{n}",
            task_id=f"task_{n}",
            owner="o",
            model="m",
            request="{}",
            created_at=1.0,
        )
        task = build(
            Task,
            id=f"task_{n}",
            kind="response",
            state="queued",
            on_restart="fail",
            owner="o",
            model="m",
            response_id=f"resp_{n}",
            params="{}",
            created_at=1.0,
            updated_at=1.0,
        )
        rules.create_task(db, task, response)
        made.append((task.id, response.id))
    rows = {r["id"]: r for r in _rows(db, TASKS, TASKS.c.id)}
    (a, ra), (b, rb) = made
    ignore = {"id", "response_id", "updated_at"}
    assert {k: v for k, v in rows[a].items() if k not in ignore} == {
        k: v for k, v in rows[b].items() if k not in ignore
    }
    responses = {r["id"]: r for r in _rows(db, RESPONSES, RESPONSES.c.id)}
    assert {k: v for k, v in responses[ra].items() if k not in {"id", "task_id"}} == {
        k: v for k, v in responses[rb].items() if k not in {"id", "task_id"}
    }
