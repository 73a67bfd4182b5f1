"""A paired client's quota, counted by the store inside the transaction that creates a task
(store.quotas, services.admission), on both backends.

- `held` counts the owner's unfinished tasks and the tokens their params hold, and nothing
  else: not finished tasks, not other owners' tasks, not a task without a budget;
- twenty creates of one client at once, each holding 10 tokens under a limit of 50: exactly
  five commit. On PostgreSQL writers run side by side at READ COMMITTED, so this holds only
  because each count first takes the owner's advisory lock (without it, several creates count
  the same committed tasks and all pass).
- A quota is shared by an approval tree (issue 43): a sub-client's (and a sub-sub-client's)
  tasks count against the client the owner approved, whichever member of the tree asks; a
  sibling the owner approved separately has its own. Twenty creates at once, spread over a
  tree's three members, each 10 tokens under a limit of 50: exactly five commit (one lock per
  tree, not per member).
- A tree's stored output (issue 43): `stored` counts the events and response output of its
  finished tasks only; at the limit a new task of any member is 403 storage_quota_exceeded,
  another tree's is not, and deleting the finished response frees the room.
"""

from __future__ import annotations

import json
import threading
import time

from sqlalchemy import insert, update
from storehelpers import make_task, new_task, open_db, query

from jupyter_lmsp.auth.scopes import OWNER, Caller
from jupyter_lmsp.protocol.errors import LMSPError
from jupyter_lmsp.services.admission import Admission
from jupyter_lmsp.store import quotas, rules
from jupyter_lmsp.store.tables import Client, Task


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
            assert quotas.usage(conn, "client_a").held == (0, 0)
        for state, budget in (("queued", 7), ("running", 11), ("cancelling", 5)):
            _own(db, make_task(db, state), "client_a", budget)
        _own(db, make_task(db, "running"), "client_a")  # no budget: counted, holds nothing
        _own(db, make_task(db, "completed"), "client_a", 1000)  # finished: holds nothing
        _own(db, make_task(db, "running"), "client_b", 1000)  # another owner's
        with db.writing() as conn:
            assert quotas.usage(conn, "client_a").held == (4, 23)
            assert quotas.usage(conn, "client_b").held == (1, 1000)
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
            assert quotas.usage(conn, client.id).held == (5, 50)
    finally:
        admission.close()
        db.dispose()


def _client(db, client_id, approved_by):
    with db.writing() as conn:
        conn.execute(
            insert(Client.__table__).values(
                id=client_id,
                name=client_id,
                token_hash=f"hash-{client_id}",
                scopes=json.dumps(["responses:write", "clients:admin"]),
                created_at=time.time(),
                paired_by="jupyter:alice",
                approved_by=approved_by,
            )
        )


def _tree(db):
    """root (the owner approved it) -> sub -> subsub; sibling (the owner approved it too)."""
    _client(db, "root", "jupyter:alice")
    _client(db, "sub", "root")
    _client(db, "subsub", "sub")
    _client(db, "sibling", "jupyter:alice")


def test_sub_clients_share_the_quota_of_the_client_the_owner_approved(db_url):
    db = open_db(db_url)
    admission = Admission(max_tasks=4, max_tokens=1000)
    try:
        _tree(db)
        for owner, budget in (("root", 100), ("sub", 200), ("subsub", 300), ("sibling", 7)):
            _own(db, make_task(db, "running"), owner, budget)
        with db.writing() as conn:
            assert quotas.approval_tree(conn, "subsub") == ("root", ["root", "sub", "subsub"])
            assert quotas.approval_tree(conn, "sibling") == ("sibling", ["sibling"])
            assert quotas.approval_tree(conn, "stranger") == ("stranger", ["stranger"])
            for member in ("root", "sub", "subsub"):
                assert quotas.usage(conn, member).held == (3, 600), member
            assert quotas.usage(conn, "sibling").held == (1, 7)

        # 600 held: a sub-sub-client's 500 more would pass a quota of its own (1000), not the
        # tree's; 400 fits, then the tree is at 4 tasks and even the root is refused.
        assert _create(db, admission, "subsub", 500) == "too_many_tokens_in_flight"
        assert _create(db, admission, "subsub", 400) == "created"
        assert _create(db, admission, "root", 1) == "too_many_tasks"
        assert _create(db, admission, "sub", 1) == "too_many_tasks"
        assert _create(db, admission, "sibling", 900) == "created"  # its own tree, its own quota
    finally:
        admission.close()
        db.dispose()


def test_concurrent_creates_across_a_tree_never_overshoot_its_tokens(db_url):
    db = open_db(db_url)
    admission = Admission(max_tasks=100, max_tokens=50)
    members = ["root", "sub", "subsub"]
    created: list[str] = []
    refused: list[str] = []
    barrier = threading.Barrier(20)

    def create(owner: str) -> None:
        task, response = new_task()
        assert response is not None
        task.owner = response.owner = owner
        task.params = json.dumps({"budget": 10})
        caller = Caller(owner, frozenset({"responses:write"}))
        barrier.wait()
        try:
            rules.create_task(db, task, response, admit=admission.quota(caller, 10))
            created.append(task.id)
        except LMSPError as e:
            refused.append(e.code)

    try:
        _tree(db)
        threads = [threading.Thread(target=create, args=(members[i % 3],)) for i in range(20)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(created) == 5
        assert refused == ["too_many_tokens_in_flight"] * 15
        with db.writing() as conn:
            assert quotas.usage(conn, "sub").held == (5, 50)
    finally:
        admission.close()
        db.dispose()


def _create(db, admission, owner, budget=1):
    task, response = new_task()
    assert response is not None
    task.owner = response.owner = owner
    task.params = json.dumps({"budget": budget})
    caller = Caller(owner, frozenset({"responses:write"}))
    try:
        rules.create_task(db, task, response, admit=admission.quota(caller, budget))
    except LMSPError as e:
        assert e.status == 403 or e.code != "storage_quota_exceeded"
        return e.code
    return "created"


def test_a_trees_finished_output_is_bounded_by_its_storage_quota(db_url):
    db = open_db(db_url)
    admissions = []
    try:
        _tree(db)
        done = make_task(db, "completed")
        _own(db, done, "subsub")
        _own(db, make_task(db, "running"), "sub", 5)  # unfinished: stores nothing yet
        # What is stored, read back as the text the store wrote.
        ((events,),) = query(
            db, "SELECT SUM(LENGTH(data)) FROM task_events WHERE task_id = ?", (done,)
        )
        ((output,),) = query(db, "SELECT LENGTH(output) FROM responses WHERE task_id = ?", (done,))
        kept = int(events) + int(output)
        assert kept > 0
        with db.writing() as conn:
            for member in ("root", "sub", "subsub"):
                assert quotas.usage(conn, member, stored=True).stored == kept, member
            assert quotas.usage(conn, "sibling", stored=True).stored == 0
        # Counted once, into the finished task's row: later checks read it, not the events.
        ((column,),) = query(db, "SELECT stored_bytes FROM tasks WHERE id = ?", (done,))
        assert column == kept

        at_limit, above, unlimited = (
            Admission(max_tasks=100, max_tokens=1000, max_stored=n) for n in (kept, kept + 1, 0)
        )
        admissions += [at_limit, above, unlimited]
        assert _create(db, at_limit, "root") == "storage_quota_exceeded"
        assert _create(db, at_limit, "subsub") == "storage_quota_exceeded"
        assert _create(db, at_limit, "sibling") == "created"  # its own tree keeps nothing
        assert _create(db, above, "sub") == "created"
        assert _create(db, unlimited, "sub") == "created"
        assert at_limit.quota(OWNER, 1) is None  # the owner has no quota at all
        # Deleting the finished response (with its task and events) frees the room.
        assert rules.delete_finished_task(db, done)
        assert _create(db, at_limit, "root") == "created"
    finally:
        for a in admissions:
            a.close()
        db.dispose()
