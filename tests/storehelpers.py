"""Helpers for the LMSP section 11 store tests.

- `open_db` makes a `Database` on a real SQLite file (WAL, as in production), never `:memory:`,
  or on a URL (a PostgreSQL database of the test cluster: the `db_url` fixture gives each store
  test both backends).
- `make_task` puts a task (with its response) in any state by driving it through the real rule
  functions: `create_task` → `append_events(to_state=LOADING)` → `start_running` →
  `append_output` → `request_cancel` / `finish`.
- `raw`, `task_row`, `events_of`, `dump` read the database with the plain driver (`sqlite3`, or
  psycopg through `PgConnection`), on a connection of their own, so the tests see what is
  committed and nothing the store's own connection may still hold.
- `check_log` asserts the invariants every task's log keeps at every committed moment: sequence
  numbers contiguous from 0, `next_sequence` equal to the event count, `response.created` first,
  at most one terminal event and only as the last event, and the last event matching the state.
"""

from __future__ import annotations

import json
import re
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import sqlalchemy.exc
from sqlalchemy.engine import Connection

from jupyter_lmsp.protocol import events as ev
from jupyter_lmsp.protocol.ids import new_id
from jupyter_lmsp.protocol.objects import response_object, usage_object
from jupyter_lmsp.store import rules
from jupyter_lmsp.store.database import Database, sqlite_url

# What a violated constraint raises: from the store, SQLAlchemy's error (wrapping the driver's);
# from the tests' own plain connections, the driver's.
try:
    import psycopg

    INTEGRITY_ERRORS: tuple[type[Exception], ...] = (
        sqlalchemy.exc.IntegrityError,
        sqlite3.IntegrityError,
        psycopg.IntegrityError,
    )
except ImportError:  # pragma: no cover
    INTEGRITY_ERRORS = (sqlalchemy.exc.IntegrityError, sqlite3.IntegrityError)
from jupyter_lmsp.store.tables import Response, Task

UNFINISHED = ("queued", "loading", "running", "cancelling")
TERMINAL = ("completed", "failed", "cancelled")
POLICIES = ("fail", "retry", "resume")

TERMINAL_EVENT_TYPES = frozenset(
    {"response.completed", "response.incomplete", "response.failed", "response.cancelled"}
)

# The event a task's log may end with, for each state the task is in (LMSP B6, section 11.2:
# the state and the events that announce it are committed together).
LAST_EVENT_FOR_STATE: dict[str, frozenset[str]] = {
    "queued": frozenset({"response.created", "response.queued"}),
    "loading": frozenset({"response.loading"}),
    "running": frozenset(
        {
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
        }
    ),
    "cancelling": frozenset({"response.cancelling", "response.output_text.delta"}),
    "completed": frozenset({"response.completed", "response.incomplete"}),
    "failed": frozenset({"response.failed"}),
    "cancelled": frozenset({"response.cancelled"}),
}

# The `status` the response object in a lifecycle event shows for each task state (LMSP B5).
STATUS_FOR_STATE = {
    "queued": {"queued"},
    "loading": {"queued"},
    "running": {"in_progress"},
    "cancelling": {"in_progress"},
    "completed": {"completed", "incomplete"},
    "failed": {"failed"},
    "cancelled": {"cancelled"},
}

# Section 11.3, the recovery table: (state found, `on_restart`) -> the state the task moves to.
# Written out literally as the seed states it, not imported from the code under test.
TABLE = {
    ("queued", "fail"): "failed",
    ("queued", "retry"): "queued",
    ("queued", "resume"): "queued",
    ("loading", "fail"): "failed",
    ("loading", "retry"): "queued",
    ("loading", "resume"): "queued",
    ("running", "fail"): "failed",
    ("running", "retry"): "queued",
    ("running", "resume"): "running",
    ("cancelling", "fail"): "cancelled",
    ("cancelling", "retry"): "cancelled",
    ("cancelling", "resume"): "cancelled",
}
assert len(TABLE) == 12

OUTPUT = [([11, 12], "Hello"), ([13], " world")]
OUTPUT_TEXT = "".join(text for _, text in OUTPUT)
OUTPUT_TOKENS = [t for ids, _ in OUTPUT for t in ids]


# ---------------------------------------------------------------------------------------------
# the database


def open_db(where: Path | str, name: str = "lmsp.sqlite") -> Database:
    """A store on a real SQLite file in `where` (a test's tmp_path), or at the URL `where`."""
    if isinstance(where, str):
        return Database(where)
    return Database(sqlite_url(Path(where) / name))


def db_path(db: Database) -> str:
    return db.url.removeprefix("sqlite:///")


class PgRow(tuple[Any, ...]):
    """A psycopg row as the tests read `sqlite3.Row`s: `row[0]`, `row["id"]`, `dict(row)`."""

    names: tuple[str, ...]

    def __new__(cls, values: Any, names: tuple[str, ...]) -> PgRow:
        row = super().__new__(cls, values)
        row.names = names
        return row

    def keys(self) -> tuple[str, ...]:
        return self.names

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, str):
            return tuple.__getitem__(self, self.names.index(key))
        return tuple.__getitem__(self, key)


def _pg_rows(cursor: Any) -> Any:
    if cursor.description is None:
        return tuple
    names = tuple(column.name for column in cursor.description)
    return lambda values: PgRow(values, names)


_NAMED = re.compile(r"(?<![:\w]):(\w+)")


def pg_style(sql: str) -> str:
    """A test's statement in SQLite's parameter style (`?`, `:name`) in psycopg's."""
    return _NAMED.sub(r"%(\1)s", sql.replace("%", "%%").replace("?", "%s"))


class PgConnection:
    """A psycopg connection (autocommit) that takes SQLite's parameter style and gives rows
    like `sqlite3.Row`: the tests' plain reads, on the driver and not through the store, work
    on both backends. `BEGIN` starts a REPEATABLE READ transaction (one snapshot, as SQLite's
    read transaction)."""

    def __init__(self, url: str) -> None:
        import psycopg

        dsn = url.replace("postgresql+psycopg://", "postgresql://")
        self.conn = psycopg.connect(dsn, autocommit=True)

    def execute(self, sql: str, params: Any = ()) -> Any:
        if sql.strip().upper() == "BEGIN":
            sql = "BEGIN ISOLATION LEVEL REPEATABLE READ"
        cursor = self.conn.cursor(row_factory=_pg_rows)
        return cursor.execute(pg_style(sql), params)

    def executemany(self, sql: str, rows: Any) -> Any:
        cursor = self.conn.cursor(row_factory=_pg_rows)
        cursor.executemany(pg_style(sql), list(rows))
        return cursor

    def close(self) -> None:
        self.conn.close()


def raw(db: Database, timeout: float = 10.0) -> Any:
    """A plain connection to the store's database, in autocommit mode: `sqlite3` on the
    store's file, or a `PgConnection`."""
    if db.is_postgres:
        return PgConnection(db.url)
    conn = sqlite3.connect(db_path(db), timeout=timeout, isolation_level=None)
    conn.row_factory = sqlite3.Row
    return conn


def query(db: Database, sql: str, params: tuple = ()) -> list[tuple]:
    """Run one statement on a connection of its own; the rows as plain tuples."""
    conn = raw(db)
    try:
        return [tuple(r) for r in conn.execute(sql, params).fetchall()]
    finally:
        conn.close()


# ---------------------------------------------------------------------------------------------
# making tasks


def new_task(
    on_restart: str = "fail", *, with_response: bool = True, created_at: float | None = None
) -> tuple[Task, Response | None]:
    """An unsaved task and its response, as a `POST /responses` with `background: true` makes."""
    now = time.time() if created_at is None else created_at
    task_id = new_id("task")
    response = None
    if with_response:
        response = Response(
            id=new_id("resp"),
            task_id=task_id,
            owner="owner",
            model="test-model",
            request=json.dumps(
                {"model": "test-model", "input": "hi", "background": True, "seed": 7}
            ),
            created_at=now,
        )
    task = Task(
        id=task_id,
        kind="response" if with_response else "model_registration",
        state="queued",
        on_restart=on_restart,
        owner="owner",
        model="test-model",
        response_id=response.id if response is not None else None,
        created_at=now,
        updated_at=now,
    )
    return task, response


def loading_events(task: Task, response: Response | None) -> list[dict[str, Any]]:
    if response is None:
        return [{"type": "task.loading", "task_id": task.id}]
    return [ev.lifecycle(ev.LOADING, response_object(response, task))]


def to_loading(db: Database, task_id: str) -> rules.Committed:
    return rules.append_events(
        db, task_id, loading_events, to_state="loading", only_from=["queued"]
    )


def to_running(db: Database, task_id: str, output: bool = True) -> None:
    """`queued` → `loading` → `running`, then (by default) the two chunks of OUTPUT."""
    to_loading(db, task_id)
    rules.start_running(db, task_id, input_tokens=3)
    if output:
        for token_ids, text in OUTPUT:
            rules.append_output(db, task_id, token_ids, text)


def running_response(db: Database, owner: str, *, background: bool = True) -> tuple[str, str]:
    """A response task of `owner` (asked for in the background, or not), created and running
    with OUTPUT written: its task id and response id."""
    task, response = new_task("fail")
    assert response is not None
    task.owner = response.owner = owner
    response.request = json.dumps({"model": "test-model", "input": "hi", "background": background})
    rules.create_task(db, task, response)
    to_running(db, task.id)
    return task.id, response.id


def usage() -> dict[str, Any]:
    """A usage object as the runner reports it (the response object's schema requires it)."""
    return usage_object(3, len(OUTPUT_TOKENS))


def make_task(
    db: Database,
    state: str,
    on_restart: str = "fail",
    *,
    with_response: bool = True,
    via: str = "running",
) -> str:
    """Create a task and drive it to `state` with the real rule functions; returns its id.

    `via` picks the path to `cancelling` (from `running` or from `loading`) and to `cancelled`
    (`queued` cancelled at once, or `running` → `cancelling` → `cancelled`).
    """
    tid = _drive(db, state, on_restart, with_response=with_response, via=via)
    row = task_row(db, tid)
    assert row is not None and row["state"] == state, (state, row)
    return tid


def make_tasks(db: Database, n: int, state: str, on_restart: str = "fail", **kw: Any) -> list[str]:
    """`n` tasks driven to `state` by the real rule functions, committed in one transaction.

    Each rule function opens `db.writing()`; here they all get the same connection (see
    `OneTransaction`), so making a thousand tasks costs one commit instead of five thousand.
    """
    with db.writing() as conn:
        shared = OneTransaction(conn)
        ids = [_drive(shared, state, on_restart, **kw) for _ in range(n)]  # type: ignore[arg-type]
    conn = raw(db)
    try:
        placeholders = ",".join("?" * len(ids))
        states = conn.execute(
            f"SELECT DISTINCT state FROM tasks WHERE id IN ({placeholders})", ids
        ).fetchall()
        assert [s[0] for s in states] == [state], states
    finally:
        conn.close()
    return ids


class OneTransaction:
    """Stands in for a `Database` inside an open write transaction: every `writing()` the
    rule functions open is that same transaction, committed (or not) by whoever opened it."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    @contextmanager
    def writing(self) -> Iterator[Connection]:
        yield self.conn


def _drive(
    db: Database, state: str, on_restart: str, *, with_response: bool = True, via: str = "running"
) -> str:
    task, response = new_task(on_restart, with_response=with_response)
    rules.create_task(db, task, response)
    tid = task.id
    if state == "queued":
        pass
    elif state == "loading":
        to_loading(db, tid)
    elif state == "running":
        to_running(db, tid)
    elif state == "cancelling":
        if via == "loading":
            to_loading(db, tid)
        else:
            to_running(db, tid)
        rules.request_cancel(db, tid)
    elif state == "completed":
        to_running(db, tid)
        rules.finish(db, tid, rules.Outcome("completed", usage=usage()))
    elif state == "failed":
        to_running(db, tid)
        error = {"code": "generation_error", "message": "boom"}
        rules.finish(db, tid, rules.Outcome("failed", error=error))
    elif state == "cancelled":
        if via == "queued":
            rules.request_cancel(db, tid)
        else:
            to_running(db, tid)
            rules.request_cancel(db, tid)
            rules.finish(db, tid, rules.Outcome("completed", usage=usage()))
    else:
        raise ValueError(state)
    return tid


# ---------------------------------------------------------------------------------------------
# reading what is committed, with plain sqlite3


def task_row(db_or_conn: Database | sqlite3.Connection, task_id: str) -> dict[str, Any] | None:
    conn = _conn(db_or_conn)
    try:
        row = conn.execute("SELECT * FROM tasks WHERE id = ?", (task_id,)).fetchone()
        return dict(row) if row is not None else None
    finally:
        _close(db_or_conn, conn)


def response_row(db_or_conn: Database | sqlite3.Connection, response_id: str) -> dict | None:
    conn = _conn(db_or_conn)
    try:
        row = conn.execute("SELECT * FROM responses WHERE id = ?", (response_id,)).fetchone()
        return dict(row) if row is not None else None
    finally:
        _close(db_or_conn, conn)


def events_of(db_or_conn: Database | sqlite3.Connection, task_id: str) -> list[dict[str, Any]]:
    """The task's committed events, in sequence order: `sequence_number`, `type`, `data`."""
    conn = _conn(db_or_conn)
    try:
        rows = conn.execute(
            "SELECT sequence_number, type, data FROM task_events WHERE task_id = ?"
            " ORDER BY sequence_number",
            (task_id,),
        ).fetchall()
        return [{"sequence_number": r[0], "type": r[1], "data": json.loads(r[2])} for r in rows]
    finally:
        _close(db_or_conn, conn)


def types_of(db_or_conn: Database | sqlite3.Connection, task_id: str) -> list[str]:
    return [e["type"] for e in events_of(db_or_conn, task_id)]


def dump(db_or_conn: Database | sqlite3.Connection) -> dict[str, list[tuple]]:
    """Every row of the tables section 11 is about, in a stable order."""
    conn = _conn(db_or_conn)
    try:
        return {
            "tasks": [tuple(r) for r in conn.execute("SELECT * FROM tasks ORDER BY id")],
            "responses": [tuple(r) for r in conn.execute("SELECT * FROM responses ORDER BY id")],
            "task_events": [
                tuple(r) for r in conn.execute("SELECT * FROM task_events ORDER BY id")
            ],
            "idempotency_keys": [
                tuple(r)
                for r in conn.execute("SELECT * FROM idempotency_keys ORDER BY caller, key")
            ],
        }
    finally:
        _close(db_or_conn, conn)


def check_log(db_or_conn: Database | sqlite3.Connection, task_id: str) -> list[dict[str, Any]]:
    """Assert the invariants of one task's committed log (see the module docstring).

    Reads the task and its events in one read transaction, so both come from the same commit.
    """
    conn = _conn(db_or_conn)
    try:
        conn.execute("BEGIN")
        try:
            task = dict(conn.execute("SELECT * FROM tasks WHERE id = ?", (task_id,)).fetchone())
            log = events_of(conn, task_id)
        finally:
            conn.execute("ROLLBACK")
    finally:
        _close(db_or_conn, conn)
    state = task["state"]
    seqs = [e["sequence_number"] for e in log]
    assert seqs == list(range(len(log))), f"{task_id}: gap or duplicate in {seqs}"
    assert task["next_sequence"] == len(log), (task_id, task["next_sequence"], len(log))
    for e in log:
        assert e["data"]["sequence_number"] == e["sequence_number"], e
        assert e["data"]["type"] == e["type"], e
    if task["kind"] == "response":
        assert log[0]["type"] == "response.created", log[0]
        terminal = [i for i, e in enumerate(log) if e["type"] in TERMINAL_EVENT_TYPES]
        if state in TERMINAL:
            assert terminal == [len(log) - 1], f"{task_id} ({state}): terminal at {terminal}"
        else:
            assert terminal == [], f"{task_id} ({state}): terminal event at {terminal}"
        last = log[-1]
        assert last["type"] in LAST_EVENT_FOR_STATE[state], (task_id, state, last["type"])
        lifecycle = [e for e in log if "response" in e["data"]]
        assert lifecycle[-1]["data"]["response"]["status"] in STATUS_FOR_STATE[state], (
            task_id,
            state,
            lifecycle[-1]["type"],
        )
    if state in TERMINAL:
        assert task["finished_at"] is not None, task
    return log


def _conn(db_or_conn: Database | sqlite3.Connection) -> Any:
    return raw(db_or_conn) if isinstance(db_or_conn, Database) else db_or_conn


def _close(db_or_conn: Database | sqlite3.Connection, conn: sqlite3.Connection) -> None:
    if isinstance(db_or_conn, Database):
        conn.close()


# ---------------------------------------------------------------------------------------------
# holding a write transaction open


class PausingDatabase(Database):
    """A `Database` whose write transactions, while `hold()` is active, stop just before
    COMMIT: every statement of the transaction has run (so it holds the write lock
    and has written its rows) but not yet committed. The test then looks at the file from
    another connection, and lets the transaction go on."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self._holding = False
        self.paused = threading.Event()
        self.release = threading.Event()

    @contextmanager
    def hold(self) -> Iterator[None]:
        self.paused.clear()
        self.release.clear()
        self._holding = True
        try:
            yield
        finally:
            self._holding = False
            self.release.set()

    @contextmanager
    def writing(self) -> Iterator[Connection]:
        with super().writing() as conn:
            yield conn
            if self._holding:
                self.paused.set()
                assert self.release.wait(30), "the test never released the transaction"


def open_pausing_db(where: Path | str, name: str = "lmsp.sqlite") -> PausingDatabase:
    if isinstance(where, str):
        return PausingDatabase(where)
    return PausingDatabase(sqlite_url(Path(where) / name))


def in_thread(fn: Any, *args: Any, **kwargs: Any) -> tuple[threading.Thread, dict[str, Any]]:
    """Run `fn` on a new thread; the dict gets its `result` or its `error`."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["result"] = fn(*args, **kwargs)
        except BaseException as exc:
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def write_lock_is_held(db: Database) -> bool:
    """True if some connection holds the write lock: BEGIN IMMEDIATE fails at once here. On
    PostgreSQL: some other session has written to the tasks or events in a transaction still
    open (it holds their ROW EXCLUSIVE table lock until it ends)."""
    if db.is_postgres:
        conn = raw(db)
        try:
            (n,) = conn.execute(
                "SELECT count(*) FROM pg_locks l JOIN pg_class c ON c.oid = l.relation"
                " WHERE c.relname IN ('tasks', 'task_events') AND l.mode = 'RowExclusiveLock'"
                " AND l.granted AND l.pid <> pg_backend_pid()"
            ).fetchone()
            return bool(n)
        finally:
            conn.close()
    conn = sqlite3.connect(db_path(db), timeout=0, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
    except sqlite3.OperationalError as exc:
        assert "locked" in str(exc), exc
        return True
    else:
        conn.execute("ROLLBACK")
        return False
    finally:
        conn.close()
