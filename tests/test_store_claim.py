"""`rules.claim_to_run`: a runner takes a task to run in one transaction, on both backends.

What the claim must do, each checked against what is committed (read on a connection of its own):
`queued` → `loading` with one `response.loading` event (`task.loading` without a response),
run; `running` (left to resume) runs as a resume with nothing appended; `cancelling` ends
`cancelled` in the claim's own transaction, with the same log `finish(cancelled)` writes, and
does not run; a terminal task, an unknown one, or one another runner holds: nothing changes,
nothing runs. Raced against `request_cancel` from another thread, round after round, every
round ends in one of the two orders and never in between: either the claim won (`loading`, the
claim ran it, the cancel then made it `cancelling`) or the cancel won (`cancelled` from
`queued`, and the claim neither ran it nor appended anything).
"""

from __future__ import annotations

import threading
import time

import pytest
from sqlalchemy import update
from sqlmodel import col
from storehelpers import (
    check_log,
    events_of,
    make_task,
    make_tasks,
    open_db,
    query,
    task_row,
    types_of,
)

from jupyter_lmsp.store import rules, runners
from jupyter_lmsp.store.tables import Task


@pytest.fixture
def db(db_url):
    database = open_db(db_url)
    yield database
    database.dispose()


def _held_by(db, task_id: str, runner_id: str) -> None:
    assert query(db, "SELECT runner_id FROM tasks WHERE id = ?", (task_id,)) == [(None,)]
    with db.writing() as conn:
        conn.execute(update(Task).where(col(Task.id) == task_id).values(runner_id=runner_id))


def test_claim_moves_a_queued_task_to_loading_and_runs_it(db):
    tid = make_task(db, "queued")
    before = events_of(db, tid)
    claim = rules.claim_to_run(db, tid, None)
    assert claim.run and not claim.resume
    assert claim.task is not None and claim.task.state == "loading"
    assert claim.response is not None and claim.response.id == claim.task.response_id
    assert task_row(db, tid)["state"] == "loading"
    log = events_of(db, tid)
    assert len(log) == len(before) + 1
    assert log[-1]["type"] == "response.loading"
    assert log[-1]["data"]["response"]["id"] == claim.response.id
    (committed,) = claim.committed
    assert [e["sequence_number"] for e in committed.events] == [len(before)]
    assert committed.events[0] == log[-1]["data"]
    check_log(db, tid)


def test_claim_of_a_task_without_response_appends_task_loading(db):
    tid = make_task(db, "queued", with_response=False)
    claim = rules.claim_to_run(db, tid, None)
    assert claim.run and not claim.resume and claim.response is None
    assert types_of(db, tid) == ["task.created", "task.loading"]
    assert task_row(db, tid)["state"] == "loading"


def test_claim_of_a_running_task_resumes_it_appending_nothing(db):
    tid = make_task(db, "running", "resume")
    before = events_of(db, tid)
    claim = rules.claim_to_run(db, tid, None)
    assert claim.run and claim.resume and claim.committed == []
    assert claim.task is not None and claim.task.state == "running"
    assert events_of(db, tid) == before


@pytest.mark.parametrize("via", ["running", "loading"])
def test_claim_of_a_cancelling_task_ends_it_as_finish_would(db, via):
    claimed, finished = make_task(db, "cancelling", via=via), make_task(db, "cancelling", via=via)
    claim = rules.claim_to_run(db, claimed, None)
    by_finish = rules.finish(db, finished, rules.Outcome("cancelled"))
    assert not claim.run and not claim.resume
    assert claim.task is not None and claim.task.state == "cancelled"
    assert task_row(db, claimed)["state"] == "cancelled"
    assert task_row(db, claimed)["runner_id"] is None
    (committed,) = claim.committed
    assert [e["type"] for e in committed.events] == [e["type"] for e in by_finish.events]
    assert types_of(db, claimed) == types_of(db, finished)
    assert types_of(db, claimed)[-1] == "response.cancelled"
    check_log(db, claimed)


@pytest.mark.parametrize("state", ["completed", "failed", "cancelled"])
def test_claim_of_a_terminal_task_changes_nothing(db, state):
    tid = make_task(db, state)
    before = (task_row(db, tid), events_of(db, tid))
    claim = rules.claim_to_run(db, tid, None)
    assert not claim.run and claim.committed == []
    assert claim.task is not None and claim.task.state == state
    assert (task_row(db, tid), events_of(db, tid)) == before


def test_claim_of_an_unknown_task_finds_nothing(db):
    claim = rules.claim_to_run(db, "task_nonexistent", None)
    assert claim == rules.Claim(None, None, [], run=False, resume=False)


@pytest.mark.parametrize("state", ["queued", "cancelling"])
def test_claim_of_a_task_another_runner_holds_changes_nothing(db, state):
    mine = runners.register(db, lease_seconds=30).id
    theirs = runners.register(db, lease_seconds=30).id
    tid = make_task(db, state)
    _held_by(db, tid, theirs)
    before = (task_row(db, tid), events_of(db, tid))
    claim = rules.claim_to_run(db, tid, mine)
    assert not claim.run and claim.committed == []
    assert (task_row(db, tid), events_of(db, tid)) == before
    # the holder itself claims it
    claim = rules.claim_to_run(db, tid, theirs)
    assert claim.run == (state == "queued")
    assert task_row(db, tid)["state"] == ("loading" if state == "queued" else "cancelled")


def _race(db, tid: str, delay: float) -> tuple[rules.Claim, rules.Committed]:
    """A claim and a cancel of `tid` from two threads released together (the cancel `delay`
    seconds later); what each returned."""
    barrier = threading.Barrier(2)
    results: dict[str, object] = {}
    errors: list[BaseException] = []

    def run(name: str, call) -> None:
        try:
            barrier.wait(10)
            if name == "cancel":
                time.sleep(delay)
            results[name] = call()
        except BaseException as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=run, args=("claim", lambda: rules.claim_to_run(db, tid, None))),
        threading.Thread(target=run, args=("cancel", lambda: rules.request_cancel(db, tid))),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors[:1]
    claim, cancel = results["claim"], results["cancel"]
    assert isinstance(claim, rules.Claim) and isinstance(cancel, rules.Committed)
    return claim, cancel


def test_claim_racing_a_cancel_ends_in_one_order_or_the_other(db):
    rounds = 40
    endings = {"claim first": 0, "cancel first": 0}
    for i, tid in enumerate(make_tasks(db, rounds, "queued")):
        got, cancelled = _race(db, tid, delay=(i % 5) * 0.0005)
        assert cancelled.changed
        state, types = task_row(db, tid)["state"], types_of(db, tid)
        if got.run:  # the claim committed first: the cancel found it loading
            endings["claim first"] += 1
            assert state == "cancelling"
            assert types == ["response.created", "response.loading", "response.cancelling"]
        else:  # the cancel committed first: the claim found it cancelled, did nothing
            endings["cancel first"] += 1
            assert got.committed == [] and got.task is not None
            assert got.task.state == "cancelled" and state == "cancelled"
            assert types == ["response.created", "response.cancelled"]
        check_log(db, tid)
    print(endings)
    assert sum(endings.values()) == rounds
