"""Admission pieces on their own: the fair queue's turns, a quota that concurrent creates on a
real SQLite file cannot overshoot, and the revocation rule (one transaction: the client, the
clients it approved, their unfinished tasks)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest
from sqlalchemy import insert, update
from storehelpers import make_task, new_task, open_db

from jupyter_lmsp.auth.scopes import Caller
from jupyter_lmsp.protocol.errors import LMSPError
from jupyter_lmsp.services.admission import Admission
from jupyter_lmsp.services.fairqueue import FairQueue, over_share
from jupyter_lmsp.store import rules
from jupyter_lmsp.store.records import table
from jupyter_lmsp.store.tables import Client, Task


def test_owners_take_turns():
    q = FairQueue()
    for i in range(5):
        q.push(f"a{i}", "alice")
    q.push("b0", "bob")
    q.push("c0", "carol")
    assert [q.pop() for _ in range(3)] == ["a0", "b0", "c0"]
    q.push("b1", "bob")  # bob comes back after alice, who waits already
    assert [q.pop() for _ in range(len(q))] == ["a1", "b1", "a2", "a3", "a4"]
    q.push("a5", "alice")
    q.push("b2", "bob")
    q.push_front("r", "bob")  # a task started again goes first
    assert q.pop() == "r" and "a5" in q and len(q) == 2


def test_an_owner_over_its_share_is_named_only_when_another_waits():
    # Slots free: nobody is over anything.
    assert over_share(["a"], ["b"], 2) is None
    # a holds both slots, b waits with none: a is over its share of 1.
    assert over_share(["a", "a"], ["b"], 2) == "a"
    # Nobody waits, or the waiting owner holds its share already: no pause.
    assert over_share(["a", "a"], [], 2) is None
    assert over_share(["a", "b"], ["b"], 2) is None
    # 8 slots, a holds 6, b 2, c waits: the share is 2, a gives one up.
    assert over_share(["a"] * 6 + ["b"] * 2, ["c"], 8) == "a"
    assert over_share(["a"] * 3 + ["b"] * 3 + ["c"] * 2, ["c"], 8) is None
    q = FairQueue()
    q.push("a1", "alice")
    q.push("b1", "bob")
    q.push_paused("p", "alice")  # first in alice's line, but alice's turn after bob's
    assert [q.pop() for _ in range(3)] == ["b1", "p", "a1"]
    q.push("x", "bob")
    assert q.remove("x") and not q.remove("x") and len(q) == 0


def test_a_quota_holds_under_concurrent_creates(tmp_path):
    db = open_db(tmp_path)
    admission = Admission(max_tasks=5, max_tokens=10**6)
    client = Caller("client_x", frozenset({"responses:write"}))
    refused: list[str] = []
    created: list[str] = []
    barrier = threading.Barrier(20)

    def create() -> None:
        task, response = new_task()
        task.owner = response.owner = client.id
        task.params = json.dumps({"budget": 10})
        barrier.wait()
        try:
            rules.create_task(db, task, response, admit=admission.quota(client, 10))
            created.append(task.id)
        except LMSPError as e:
            refused.append(e.code)

    threads = [threading.Thread(target=create) for _ in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(created) == 5 and refused == ["too_many_tasks"] * 15
    assert (
        admission.quota(Caller("jupyter:alice", frozenset()), 10**9) is None
    )  # a Jupyter user: none
    with pytest.raises(LMSPError) as e:
        admission.quota(client, 10**7)
    assert e.value.status == 400 and e.value.code == "quota_exceeded"
    admission.close()


def test_revoking_cancels_the_clients_tasks_and_those_it_approved(tmp_path):
    db = open_db(tmp_path)
    clients = [
        Client(id="client_a", name="a", token_hash="h1", scopes="[]", created_at=1),
        Client(
            id="client_b",
            name="b",
            token_hash="h2",
            scopes="[]",
            created_at=1,
            approved_by="client_a",
        ),
        Client(id="client_c", name="c", token_hash="h3", scopes="[]", created_at=1),
    ]
    with db.writing() as conn:
        conn.execute(insert(table(Client)), [c.model_dump() for c in clients])
    ids = {}
    tasks = table(Task)
    for owner, state in (("client_a", "queued"), ("client_b", "running"), ("client_c", "running")):
        task_id = make_task(db, state, on_restart="resume")
        with db.writing() as conn:
            conn.execute(update(tasks).where(tasks.c.id == task_id).values(owner=owner))
        ids[owner] = task_id
    done = make_task(db, "completed")
    with db.writing() as conn:
        conn.execute(update(tasks).where(tasks.c.id == done).values(owner="client_a"))
    revocation = rules.revoke_client(db, "client_a")
    assert revocation is not None
    assert [c.id for c in revocation.clients] == ["client_a", "client_b"]
    states = {c.task.id: c.task.state for c in revocation.committed}
    assert states == {ids["client_a"]: "cancelled", ids["client_b"]: "cancelling"}
    for committed in revocation.committed:
        assert json.loads(committed.task.error)["code"] == "client_revoked"
        assert committed.events[-1]["response"]["error"]["code"] == "client_revoked"
    assert rules.revoke_client(db, "client_nope") is None
    # The unrelated client's task and the finished one are untouched; at the next start-up
    # the cancelling task ends cancelled, never resumed.
    report = rules.recover_at_startup(db)
    assert report.transitions.get("cancelling->cancelled") == 1
    assert report.transitions.get("running->running") == 1


# A process whose tokenizer warm-up never ends: it must exit all the same.
WARM_UP_NEVER_ENDS = """
import threading
from types import SimpleNamespace
from jupyter_lmsp.services.admission import Admission

admission = Admission()
started = threading.Event()

def warm(key, path):
    started.set()
    threading.Event().wait(600)

admission.counter.warm = warm
admission.warm(SimpleNamespace(path="/nowhere", digest="x"))
assert started.wait(60)
admission.close()
"""


def test_a_server_exits_without_waiting_for_the_tokenizer_warm_up():
    # A server stopped soon after its start used to wait for the warm-up (importing
    # transformers and loading the tokenizer, seconds of CPU) before it could exit.
    done = subprocess.run([sys.executable, "-c", WARM_UP_NEVER_ENDS], timeout=60)
    assert done.returncode == 0
