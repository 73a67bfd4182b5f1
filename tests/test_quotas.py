"""A paired client's quota, counted by the store inside the transaction that creates a task
(store.quotas, services.admission), on both backends.

- `held` counts the owner's unfinished tasks and the tokens their params hold, and nothing
  else: not finished tasks, not other owners' tasks, not a task without a budget;
- twenty creates of one client at once, each holding 10 tokens under a limit of 50: exactly
  five commit. On PostgreSQL writers run side by side at READ COMMITTED, so this holds only
  because each count first takes the owner's advisory lock (without it, several creates count
  the same committed tasks and all pass).
"""

from __future__ import annotations

import json
import threading

from sqlalchemy import update
from storehelpers import make_task, new_task, open_db

from jupyter_lmsp.auth.scopes import Caller
from jupyter_lmsp.protocol.errors import LMSPError
from jupyter_lmsp.services.admission import Admission
from jupyter_lmsp.store import quotas, rules
from jupyter_lmsp.store.tables import Task


def _own(db, task_id, owner, budget=None):
    params = json.dumps({} if budget is None else {"budget": budget})
    with db.writing() as conn:
        conn.execute(
            update(Task.__table__)
            .where(Task.__table__.c.id == task_id)
            .values(owner=owner, params=params)
        )


def test_held_counts_the_owners_unfinished_tasks_and_their_budgets(db_url):
    db = open_db(db_url)
    try:
        with db.writing() as conn:
            assert quotas.held(conn, "client_a") == (0, 0)
        for state, budget in (("queued", 7), ("running", 11), ("cancelling", 5)):
            _own(db, make_task(db, state), "client_a", budget)
        _own(db, make_task(db, "running"), "client_a")  # no budget: counted, holds nothing
        _own(db, make_task(db, "completed"), "client_a", 1000)  # finished: holds nothing
        _own(db, make_task(db, "running"), "client_b", 1000)  # another owner's
        with db.writing() as conn:
            assert quotas.held(conn, "client_a") == (4, 23)
            assert quotas.held(conn, "client_b") == (1, 1000)
    finally:
        db.dispose()


def test_concurrent_creates_of_one_client_never_overshoot_its_tokens(db_url):
    db = open_db(db_url)
    admission = Admission(max_tasks=100, max_tokens=50)
    client = Caller("client_x", frozenset({"responses:write"}))
    created: list[str] = []
    refused: list[str] = []
    barrier = threading.Barrier(20)

    def create() -> None:
        task, response = new_task()
        assert response is not None
        task.owner = response.owner = client.id
        task.params = json.dumps({"budget": 10})
        barrier.wait()
        try:
            rules.create_task(db, task, response, admit=admission.quota(client, 10))
            created.append(task.id)
        except LMSPError as e:
            refused.append(e.code)

    threads = [threading.Thread(target=create) for _ in range(20)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(created) == 5
        assert refused == ["too_many_tokens_in_flight"] * 15
        with db.writing() as conn:
            assert quotas.held(conn, client.id) == (5, 50)
    finally:
        admission.close()
        db.dispose()
