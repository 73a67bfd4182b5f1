"""A create that finds a free slot claims its task in its own transaction (issue 42), inside
a real Jupyter Server with the test model.

What these tests prove, from the statements each committed transaction ran (SQLAlchemy's
engine events on the server's own database):

- with a slot free and nobody waiting, the transaction that inserts a response's task also
  writes its `response.loading`: one commit, and the job goes to the worker right after it;
- with the one slot taken, the create commits the task `queued` alone, and the runner's claim
  writes `response.loading` later, in a transaction of its own; both tasks' lifecycles have
  the same events in the same order;
- a create refused inside its transaction, or failing before it, gives its slot back: the
  next request runs, with one slot in all;
- a worker that dies between a create's reservation and its commit (its recovery ran before
  the task existed) leaves no task stuck in `loading`: the task gets the recovery the
  worker's tasks got, is queued again, and completes on the new worker.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from jpserver import MODEL, ServerPool, call, server_config, token_delay, wait_state
from sqlalchemy import event

from jupyter_lmsp.protocol.errors import LMSPError
from jupyter_lmsp.services import responses
from jupyter_lmsp.store import rules

pytest_plugins = ["pytest_jupyter.jupyter_server"]
pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def server_pool(tmp_path_factory, test_model_dir):
    """One server with a single batch row for the module's tests (another for those with a
    `token_delay`)."""
    with ServerPool(tmp_path_factory, test_model_dir) as pool:
        yield pool


@pytest.fixture
def server(server_pool, request):
    return server_pool.get(
        token_delay(request), lambda data: server_config(data, request, max_batch_size=1)
    )


@pytest.fixture
def jp_fetch(server):
    client = server.client()
    yield client.fetch
    client.close()


def _extension(server: Any) -> Any:
    (extension,) = server.app.extension_manager.extension_apps["jupyter_lmsp"]
    return extension


class Transactions:
    """The statements (with their parameters) of each transaction committed on a database
    engine, in commit order, while it is recorded."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.lock = threading.Lock()
        self.open: dict[int, list[str]] = {}
        self.committed: list[str] = []

    def _statement(self, conn, cursor, statement, parameters, context, executemany) -> None:
        with self.lock:
            self.open.setdefault(id(conn), []).append(f"{statement} {parameters!r}")

    def _commit(self, conn) -> None:
        with self.lock:
            self.committed.append("\n".join(self.open.pop(id(conn), [])))

    def _rollback(self, conn) -> None:
        with self.lock:
            self.open.pop(id(conn), None)

    def __enter__(self) -> Transactions:
        event.listen(self.engine, "before_cursor_execute", self._statement)
        event.listen(self.engine, "commit", self._commit)
        event.listen(self.engine, "rollback", self._rollback)
        return self

    def __exit__(self, *exc: object) -> None:
        event.remove(self.engine, "before_cursor_execute", self._statement)
        event.remove(self.engine, "commit", self._commit)
        event.remove(self.engine, "rollback", self._rollback)

    def creating(self, task_id: str) -> str:
        """The one committed transaction that inserted the task."""
        with self.lock:
            found = [t for t in self.committed if "INSERT INTO tasks" in t and task_id in t]
        assert len(found) == 1, found
        return found[0]

    def writing(self, task_id: str, event_type: str) -> list[str]:
        with self.lock:
            return [t for t in self.committed if task_id in t and f"'{event_type}'" in t]


def _event_types(server: Any, task_id: str) -> list[str]:
    path = server.data_dir / "lmsp.sqlite"
    with sqlite3.connect(path) as db:
        rows = db.execute(
            "SELECT type FROM task_events WHERE task_id = ? ORDER BY sequence_number", (task_id,)
        ).fetchall()
    return [r[0] for r in rows]


def _lifecycle(types: list[str]) -> list[str]:
    """The task's state changes: its events other than those of its output."""
    return [t for t in types if t.count(".") == 1]


async def _create(jp_fetch, **extra: Any) -> tuple[int, dict[str, Any]]:
    body = {"model": MODEL, "input": "Say something.", "background": True, "temperature": 0}
    status, response, _ = await call(jp_fetch, "POST", "responses", body | extra)
    return status, response


async def test_a_create_with_a_free_slot_claims_its_task_in_the_same_transaction(server, jp_fetch):
    with Transactions(_extension(server).db.engine) as transactions:
        status, response = await _create(jp_fetch, max_output_tokens=4)
        assert status == 202, response
        task_id = response["task_id"]
        await wait_state(jp_fetch, task_id, {"completed"})
    created = transactions.creating(task_id)
    assert "'response.created'" in created and "'response.loading'" in created, created
    # Written once: no claim of its own after the create's.
    assert transactions.writing(task_id, "response.loading") == [created]
    assert _lifecycle(_event_types(server, task_id)) == [
        "response.created",
        "response.loading",
        "response.in_progress",
        "response.incomplete",  # its max_output_tokens reached
    ]


@pytest.mark.token_delay(0.02)
async def test_a_create_while_the_slot_is_taken_is_queued_and_claimed_later(server, jp_fetch):
    with Transactions(_extension(server).db.engine) as transactions:
        _, first = await _create(jp_fetch, max_output_tokens=4000)
        await wait_state(jp_fetch, first["task_id"], {"running"})
        status, second = await _create(jp_fetch, max_output_tokens=4)
        assert status == 202, second
        _, task, _ = await call(jp_fetch, "GET", f"tasks/{second['task_id']}")
        assert task["state"] == "queued"
        await call(jp_fetch, "POST", f"tasks/{first['task_id']}/cancel")
        await wait_state(jp_fetch, second["task_id"], {"completed"})
    # The first took the free slot in its create; the second waited, claimed apart.
    assert "'response.loading'" in transactions.creating(first["task_id"])
    created = transactions.creating(second["task_id"])
    assert "'response.loading'" not in created, created
    (claimed,) = transactions.writing(second["task_id"], "response.loading")
    assert claimed != created and "INSERT INTO tasks" not in claimed
    assert _lifecycle(_event_types(server, second["task_id"])) == [
        "response.created",
        "response.loading",
        "response.in_progress",
        "response.incomplete",  # its max_output_tokens reached
    ]


async def test_a_create_refused_in_its_transaction_gives_its_slot_back(
    server, jp_fetch, monkeypatch
):
    runner = _extension(server).ctx.runner
    create_task = rules.create_task

    def refused(*args: Any, **kwargs: Any) -> Any:
        # Inside the create's transaction, as a caller's quota refuses it (`admit`).
        assert runner.holds(args[1].id)  # the slot was taken before the transaction
        raise LMSPError(429, "rate_limit_exceeded", "Refused for the test.")

    monkeypatch.setattr(rules, "create_task", refused)
    status, body = await _create(jp_fetch, max_output_tokens=4)
    assert status == 429, body
    monkeypatch.setattr(rules, "create_task", create_task)
    assert runner.slots.active_count() == 0
    # One slot in all: a slot kept by the refused create would hold this one `queued`.
    status, response = await _create(jp_fetch, max_output_tokens=4)
    assert status == 202, response
    await wait_state(jp_fetch, response["task_id"], {"completed"}, timeout=30)


async def test_a_create_that_fails_before_its_transaction_gives_its_slot_back(
    server, jp_fetch, monkeypatch
):
    runner = _extension(server).ctx.runner

    def broken(*args: Any, **kwargs: Any) -> Any:
        # Building the create's rows, on its database thread, before its transaction.
        raise LMSPError(429, "rate_limit_exceeded", "Refused for the test.")

    monkeypatch.setattr(responses, "new_record", broken)
    status, body = await _create(jp_fetch, max_output_tokens=4)
    assert status == 429, body
    monkeypatch.undo()
    assert runner.slots.active_count() == 0
    status, response = await _create(jp_fetch, max_output_tokens=4)
    assert status == 202, response
    await wait_state(jp_fetch, response["task_id"], {"completed"}, timeout=30)


def _until(predicate: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


async def test_a_worker_that_dies_while_a_create_commits_leaves_no_task_loading(
    server, jp_fetch, monkeypatch
):
    runner = _extension(server).ctx.runner
    # A first request starts the worker and loads the model.
    _, warm = await _create(jp_fetch, max_output_tokens=2)
    await wait_state(jp_fetch, warm["task_id"], {"completed"})
    db = _extension(server).ctx.db
    grouped = db.grouped
    seen: list[str] = []

    def worker_dies_first() -> Any:
        # (the create's database thread, its slot reserved, before its transaction) The
        # worker dies, and its exit's recovery commits before the task is written: the runner
        # has forgotten the task by then.
        (task,) = runner.slots.active()
        seen.append(task.task_id)
        os.kill(runner.worker_info["pid"], signal.SIGKILL)
        _until(lambda: runner.slots.get(task.task_id) is None)
        return grouped()

    monkeypatch.setattr(db, "grouped", worker_dies_first)
    status, response = await _create(jp_fetch, max_output_tokens=4)
    monkeypatch.setattr(db, "grouped", grouped)
    assert status == 202, response
    assert seen == [response["task_id"]]
    task = await wait_state(jp_fetch, response["task_id"], {"completed", "failed"}, timeout=90)
    assert task["state"] == "completed", task
    types = _lifecycle(_event_types(server, response["task_id"]))
    # Claimed in its create, sent back to the queue by the recovery, claimed again.
    assert types == [
        "response.created",
        "response.loading",
        "response.queued",
        "response.loading",
        "response.in_progress",
        "response.incomplete",  # its max_output_tokens reached
    ], types


@pytest.fixture(autouse=True)
def _no_task_left_running(server) -> Iterator[None]:
    yield
    _until(lambda: _extension(server).ctx.runner.slots.active_count() == 0, timeout=30)
