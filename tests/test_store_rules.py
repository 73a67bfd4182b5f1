"""LMSP section 11.2, one test (or a few) per rule, against a real SQLite file.

What these tests prove, rule by rule:

1. *Persist a task before 202*: when `create_task` returns, another connection (plain `sqlite3`)
   already sees the task, its response and its `response.created` event (sequence 0), and a
   reopened store does too; a `create_task` that fails mid-transaction leaves nothing behind.
2. *Sequence numbers and state in one transaction*: logs are contiguous from 0 and
   `next_sequence` equals the event count after every step; a rule whose transaction fails
   changes neither state nor events (and leaves no gap); a reader on another connection never
   sees the new state without its event or the other way round, neither while the write is held
   open before COMMIT nor while polling during a stream of writes; concurrent appends to one
   task never collide.
3. *Atomic cancellation*: `queued` → `cancelled` at once; `running`/`loading` → `cancelling`, and
   then whatever the generation reports the task ends `cancelled`; a completed task stays
   completed; terminal states never change again; a cancelling task cannot be moved back.
4. *Retention*: `purge_expired` deletes finished tasks older than the retention period with
   their events and responses, and keeps the younger ones whole.
5. *Never delete unfinished tasks*: however old, and even with a bogus `finished_at`.
6. *Recovery examines every leftover task*: every task in `queued`, `loading`, `running` and
   `cancelling` is examined and gets its 11.3 transition (the full table is in
   test_recovery_table.py).
"""

from __future__ import annotations

import json
import random
import threading
import time

import pytest
from sqlalchemy import event
from storehelpers import (
    INTEGRITY_ERRORS,
    OUTPUT_TEXT,
    OUTPUT_TOKENS,
    POLICIES,
    TERMINAL_EVENT_TYPES,
    UNFINISHED,
    check_log,
    dump,
    events_of,
    in_thread,
    loading_events,
    make_task,
    make_tasks,
    new_task,
    open_db,
    open_pausing_db,
    query,
    raw,
    response_row,
    task_row,
    to_loading,
    types_of,
    usage,
    write_lock_is_held,
)

from jupyter_lmsp.protocol import events as ev
from jupyter_lmsp.protocol.objects import usage_object
from jupyter_lmsp.store import queries, rules
from jupyter_lmsp.store.database import Database
from jupyter_lmsp.store.tables import IdempotencyKey

DAY = 86_400.0


@pytest.fixture
def db(db_url):
    database = open_db(db_url)
    yield database
    database.dispose()


def _boom(*_args, **_kwargs):
    raise RuntimeError("injected failure")


# ---------------------------------------------------------------------------------------------
# 1. MUST persist a task before returning 202 Accepted


def test_create_task_is_committed_when_it_returns(db):
    task, response = new_task("resume")
    now = time.time()
    key = IdempotencyKey(
        caller="owner",
        key="key-1",
        request_digest="sha256:abc",
        status_code=202,
        body="{}",
        created_at=now,
        expires_at=now + DAY,
    )
    committed = rules.create_task(db, task, response, idempotency=key)

    # Another connection, opened only now, with nothing shared with the store's engine.
    conn = raw(db)
    try:
        row = conn.execute(
            "SELECT state, next_sequence, response_id FROM tasks WHERE id = ?", (task.id,)
        ).fetchone()
        assert tuple(row) == ("queued", 1, response.id)
        assert tuple(
            conn.execute("SELECT task_id FROM responses WHERE id = ?", (response.id,)).fetchone()
        ) == (task.id,)
        events = conn.execute(
            "SELECT sequence_number, type, data FROM task_events WHERE task_id = ?", (task.id,)
        ).fetchall()
        assert [(s, t) for s, t, _ in events] == [(0, "response.created")]
        data = json.loads(events[0][2])
        assert data["sequence_number"] == 0
        assert data["response"]["id"] == response.id
        assert data["response"]["status"] == "queued"
        # The idempotency record of the request that started the work, in the same commit.
        assert tuple(
            conn.execute(
                "SELECT request_digest FROM idempotency_keys"
                " WHERE caller = 'owner' AND key = 'key-1'"
            ).fetchone()
        ) == ("sha256:abc",)
    finally:
        conn.close()

    # What create_task returned (and the handler will publish) is what is on disk.
    assert [e["sequence_number"] for e in committed.events] == [0]
    assert committed.events[0] == data

    # A store opened afresh on the file (a restart right after the 202) finds it all.
    db.dispose()
    reopened = Database(db.url)
    try:
        found = queries.get_task_and_response(reopened, task.id)
        assert found is not None and found[0].state == "queued" and found[1].id == response.id
        assert [e["type"] for e in queries.list_events(reopened, task.id)] == ["response.created"]
    finally:
        reopened.dispose()


def test_create_task_failing_mid_transaction_leaves_nothing_bad_idempotency_row(db):
    make_task(db, "running")  # something already there, which must stay as it is
    before = dump(db)
    task, response = new_task()
    now = time.time()
    # request_digest is NOT NULL: the last INSERT fails, after the task, the response
    # and the response.created event were already written in the transaction.
    bad = IdempotencyKey(
        caller="owner", key="k", request_digest=None, created_at=now, expires_at=now + DAY
    )
    with pytest.raises(INTEGRITY_ERRORS):
        rules.create_task(db, task, response, idempotency=bad)
    assert dump(db) == before
    assert task_row(db, task.id) is None
    assert response_row(db, response.id) is None
    assert events_of(db, task.id) == []


def test_create_task_failing_mid_transaction_leaves_nothing_duplicate_task_id(db):
    existing = make_task(db, "queued")
    before = dump(db)
    task, response = new_task()
    task.id = existing  # the response is inserted first, then the task insert fails
    response.task_id = existing
    with pytest.raises(INTEGRITY_ERRORS):
        rules.create_task(db, task, response)
    assert dump(db) == before
    assert response_row(db, response.id) is None
    assert types_of(db, existing) == ["response.created"]


def test_create_task_failing_in_first_event_leaves_nothing(db):
    make_task(db, "running")  # something already there, which must stay as it is
    before = dump(db)
    task, response = new_task()
    ran: list[str] = []

    def fail_on_the_event(_conn, _cursor, statement, *_args):
        # On the store's connection, inside its transaction: the response's and the task's
        # rows are written by then, and the INSERT of the first event never runs.
        ran.append(statement.split("(", 1)[0].strip())
        if statement.startswith("INSERT INTO task_events"):
            raise RuntimeError("injected failure")

    event.listen(db.engine, "before_cursor_execute", fail_on_the_event)
    try:
        with pytest.raises(RuntimeError, match="injected"):
            rules.create_task(db, task, response)
    finally:
        event.remove(db.engine, "before_cursor_execute", fail_on_the_event)
    assert ran[-3:] == ["INSERT INTO responses", "INSERT INTO tasks", "INSERT INTO task_events"]
    assert dump(db) == before
    assert task_row(db, task.id) is None
    assert response_row(db, response.id) is None


# ---------------------------------------------------------------------------------------------
# 2. MUST update event sequence numbers and the task's state in the same transaction


def _committed_tail_matches(db, task_id, before_count, committed):
    """The events a rule function returned are exactly the rows it added to the log."""
    log = events_of(db, task_id)
    added = log[before_count:]
    assert [e["data"] for e in added] == committed.events
    return log


LIFECYCLES = {
    "completed": ["load", "start", "out", "out", ("finish", "completed")],
    "incomplete": ["load", "start", "out", ("finish", "incomplete")],
    "failed": ["load", "start", "out", ("finish", "failed")],
    "cancelled-queued": ["cancel", ("finish", "completed")],
    "cancelled-loading": ["load", "cancel", "start", "out", ("finish", "completed")],
    "cancelled-running": ["load", "start", "out", "cancel", "out", ("finish", "completed")],
}


def _step(db, tid, step):
    if step == "load":
        return to_loading(db, tid)
    if step == "start":
        return rules.start_running(db, tid, input_tokens=3)
    if step == "out":
        return rules.append_output(db, tid, [random.randrange(1000)], "tok ")
    if step == "cancel":
        return rules.request_cancel(db, tid)
    _, how = step
    if how == "completed":
        return rules.finish(db, tid, rules.Outcome("completed", usage=usage()))
    if how == "incomplete":
        outcome = rules.Outcome("completed", incomplete_reason="max_output_tokens", usage=usage())
        return rules.finish(db, tid, outcome)
    error = {"code": "generation_error", "message": "boom"}
    return rules.finish(db, tid, rules.Outcome("failed", error=error))


@pytest.mark.parametrize("lifecycle", LIFECYCLES)
def test_sequence_numbers_and_state_move_together_at_every_step(db, lifecycle):
    task, response = new_task()
    committed = rules.create_task(db, task, response)
    tid = task.id
    check_log(db, tid)
    for step in LIFECYCLES[lifecycle]:
        count = len(events_of(db, tid))
        committed = _step(db, tid, step)
        log = _committed_tail_matches(db, tid, count, committed)
        check_log(db, tid)  # contiguous from 0, next_sequence == count, state == last event
        assert task_row(db, tid)["next_sequence"] == len(log)
        assert committed.task.next_sequence == len(log)
        assert committed.task.state == task_row(db, tid)["state"]
    final = task_row(db, tid)["state"]
    expected = "completed" if lifecycle == "incomplete" else lifecycle.split("-")[0]
    assert final == expected
    if lifecycle == "incomplete":
        assert types_of(db, tid)[-1] == "response.incomplete"


def _failing_lifecycle_event(kind):
    real = ev.lifecycle

    def lifecycle(type_, response):
        if type_ == kind:
            raise RuntimeError("injected failure")
        return real(type_, response)

    return lifecycle


# Each case: the state to start from, the rule call, and what to break inside its transaction,
# always after the rule has already changed the task (state, snapshot or next_sequence).
FAILURES = {
    "append_events: build raises": (
        "queued",
        lambda db, tid, mp: rules.append_events(db, tid, _boom, to_state="loading"),
    ),
    "append_events: second event unserialisable": (
        "queued",
        lambda db, tid, mp: rules.append_events(
            db,
            tid,
            lambda t, r: [*loading_events(t, r), {"type": "x", "bad": object()}],
            to_state="loading",
        ),
    ),
    "start_running": (
        "loading",
        lambda db, tid, mp: (
            mp.setattr(ev, "item_opened", _boom),
            rules.start_running(db, tid, input_tokens=3),
        ),
    ),
    "append_output": (
        "running",
        lambda db, tid, mp: (
            mp.setattr(ev, "text_delta", _boom),
            rules.append_output(db, tid, [1], "x"),
        ),
    ),
    "request_cancel running": (
        "running",
        lambda db, tid, mp: (
            mp.setattr(ev, "lifecycle", _failing_lifecycle_event(ev.CANCELLING)),
            rules.request_cancel(db, tid),
        ),
    ),
    "request_cancel queued": (
        "queued",
        lambda db, tid, mp: (
            mp.setattr(ev, "lifecycle", _failing_lifecycle_event(ev.CANCELLED)),
            rules.request_cancel(db, tid),
        ),
    ),
    "finish": (
        "running",
        lambda db, tid, mp: (
            mp.setattr(ev, "lifecycle", _failing_lifecycle_event(ev.COMPLETED)),
            rules.finish(db, tid, rules.Outcome("completed", usage=usage())),
        ),
    ),
}


@pytest.mark.parametrize("case", FAILURES)
def test_failing_transaction_changes_neither_state_nor_events(db, monkeypatch, case):
    state, call = FAILURES[case]
    tid = make_task(db, state)
    other = make_task(db, "running")
    before = dump(db)
    with pytest.raises((RuntimeError, TypeError)):
        call(db, tid, monkeypatch)
    monkeypatch.undo()
    assert dump(db) == before
    check_log(db, tid)
    # No sequence number was used up: the next successful write continues without a gap.
    count = len(events_of(db, tid))
    rules.request_cancel(db, tid)
    log = check_log(db, tid)
    assert log[count]["sequence_number"] == count
    check_log(db, other)


def test_outputs_of_several_tasks_commit_together_or_not_at_all(db, monkeypatch):
    """The runner commits every running task's tokens in one `append_outputs` transaction:
    each task gets its delta and snapshot with its own next sequence number, a task that is
    gone is skipped, and a failure part-way leaves every task as it was."""
    first, second = make_task(db, "running"), make_task(db, "running")
    before = {tid: len(events_of(db, tid)) for tid in (first, second)}
    committed = rules.append_outputs(
        db, {first: ([5], " a"), "task_gone": ([6], " b"), second: ([7, 8], " cd")}
    )
    assert [c.task.id for c in committed] == [first, second]
    for tid, text in ((first, " a"), (second, " cd")):
        log = check_log(db, tid)
        assert len(log) == before[tid] + 1 and log[-1]["data"]["delta"] == text
        assert json.loads(task_row(db, tid)["snapshot"])["text"].endswith(text)

    state = dump(db)
    real, calls = rules.Attempt.apply, []

    def fail_on_second(attempt, batch, lookup=None):  # type: ignore[no-untyped-def]
        calls.append(batch)
        if len(calls) == 2:
            raise RuntimeError("injected failure on the second task")
        return real(attempt, batch, lookup)

    monkeypatch.setattr(rules.Attempt, "apply", fail_on_second)
    with pytest.raises(RuntimeError, match="injected"):
        rules.append_outputs(db, {first: ([9], " e"), second: ([10], " f")})
    assert dump(db) == state


def _lifecycle_calls(tid):
    return [
        lambda db: to_loading(db, tid),
        lambda db: rules.start_running(db, tid, input_tokens=3),
        lambda db: rules.append_output(db, tid, [5, 6], "ab"),
        lambda db: rules.request_cancel(db, tid),
        lambda db: rules.append_output(db, tid, [7], "c"),
        lambda db: rules.finish(db, tid, rules.Outcome("completed", usage=usage())),
    ]


def test_reader_during_a_write_sees_old_state_and_old_events_never_half(db_url):
    """Each rule's transaction is stopped after it wrote everything but before COMMIT; another
    connection then sees the task exactly as before (state and events), the write lock is held,
    and right after COMMIT it sees the new state and the new events together."""
    pdb = open_pausing_db(db_url)
    try:
        task, response = new_task()
        rules.create_task(pdb, task, response)
        tid = task.id
        for call in _lifecycle_calls(tid):
            before = dump(pdb)
            with pdb.hold():
                thread, out = in_thread(call, pdb)
                assert pdb.paused.wait(10), out
                # Mid-transaction: the rows are written but not committed.
                assert write_lock_is_held(pdb)
                assert dump(pdb) == before
                check_log(pdb, tid)
            thread.join(10)
            assert "error" not in out, out
            committed = out["result"]
            assert committed.changed and committed.events
            after = check_log(pdb, tid)
            assert task_row(pdb, tid)["state"] == committed.task.state
            assert [e["data"] for e in after[-len(committed.events) :]] == committed.events
            assert not write_lock_is_held(pdb)
        assert task_row(pdb, tid)["state"] == "cancelled"
    finally:
        pdb.dispose()


def test_concurrent_reader_always_sees_state_and_events_consistent(db):
    """A reader polls the whole store with plain sqlite3 while a writer drives tasks through
    every kind of lifecycle; in every snapshot it takes, each task's state, next_sequence and
    log agree."""
    stop = threading.Event()
    snapshots = []
    problems = []

    def reader():
        conn = raw(db)
        try:
            while not stop.is_set() or not snapshots:
                conn.execute("BEGIN")
                tasks = conn.execute("SELECT id FROM tasks").fetchall()
                for (tid,) in tasks:
                    try:
                        check_log(_NoTxn(conn), tid)
                    except AssertionError as exc:
                        problems.append(exc)
                conn.execute("ROLLBACK")
                snapshots.append(len(tasks))
        finally:
            conn.close()

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    try:
        for lifecycle in list(LIFECYCLES) * 3:
            task, response = new_task()
            rules.create_task(db, task, response)
            for step in LIFECYCLES[lifecycle]:
                _step(db, task.id, step)
    finally:
        stop.set()
        thread.join(30)
    assert not problems, problems[:3]
    assert len(snapshots) >= 5  # the reader really ran alongside the writes
    for (tid,) in query(db, "SELECT id FROM tasks"):
        check_log(db, tid)


class _NoTxn:
    """A sqlite3 connection already inside the caller's read transaction: check_log's own
    BEGIN/ROLLBACK become no-ops, so every task is checked in the caller's one snapshot."""

    def __init__(self, conn):
        self._conn = conn

    def execute(self, sql, *args):
        if sql in ("BEGIN", "ROLLBACK"):
            return None
        return self._conn.execute(sql, *args)


def test_concurrent_appends_to_one_task_never_share_a_sequence_number(db):
    tid = make_task(db, "running")
    base = len(events_of(db, tid))
    threads, per_thread = 6, 25
    barrier = threading.Barrier(threads)
    errors = []

    def writer(n):
        try:
            barrier.wait(10)
            for i in range(per_thread):
                rules.append_output(db, tid, [n * 1000 + i], f"<{n}.{i}>")
        except BaseException as exc:
            errors.append(exc)

    workers = [threading.Thread(target=writer, args=(n,)) for n in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    assert not errors, errors[:3]
    log = check_log(db, tid)
    deltas = [e["data"]["delta"] for e in log[base:]]
    assert len(deltas) == threads * per_thread
    snapshot = json.loads(task_row(db, tid)["snapshot"])
    # The snapshot committed with each delta covers exactly the deltas before it, in log order.
    assert snapshot["text"] == OUTPUT_TEXT + "".join(deltas)
    assert snapshot["token_ids"] == OUTPUT_TOKENS + [
        int(d[1:-1].split(".")[0]) * 1000 + int(d[1:-1].split(".")[1]) for d in deltas
    ]


# ---------------------------------------------------------------------------------------------
# 3. MUST make the cancellation transition atomic: a task cannot be cancelled and then complete


def test_cancel_queued_task_is_cancelled_at_once(db):
    tid = make_task(db, "queued")
    committed = rules.request_cancel(db, tid)
    assert committed.changed
    assert [e["type"] for e in committed.events] == ["response.cancelled"]
    assert committed.events[0]["response"]["status"] == "cancelled"
    row = task_row(db, tid)
    assert row["state"] == "cancelled" and row["finished_at"] is not None
    assert types_of(db, tid) == ["response.created", "response.cancelled"]
    check_log(db, tid)
    # The runner picking it up afterwards can do nothing with it.
    before = dump(db)
    assert not to_loading(db, tid).changed
    assert not rules.start_running(db, tid, input_tokens=1).changed
    assert not rules.finish(db, tid, rules.Outcome("completed", usage=usage())).changed
    assert dump(db) == before


@pytest.mark.parametrize("from_state", ["loading", "running"])
@pytest.mark.parametrize(
    "outcome",
    [
        rules.Outcome("completed", usage=usage_object(1, 1)),
        rules.Outcome("completed", incomplete_reason="max_output_tokens"),
        rules.Outcome("failed", error={"code": "generation_error", "message": "x"}),
    ],
    ids=["completed", "incomplete", "failed"],
)
def test_cancel_running_task_ends_cancelled_whatever_the_generation_reports(
    db, from_state, outcome
):
    tid = make_task(db, from_state)
    committed = rules.request_cancel(db, tid)
    assert committed.changed
    assert [e["type"] for e in committed.events] == ["response.cancelling"]
    assert task_row(db, tid)["state"] == "cancelling"
    check_log(db, tid)
    assert not rules.request_cancel(db, tid).changed  # a second cancel adds nothing

    done = rules.finish(db, tid, outcome)
    assert done.changed and done.task.state == "cancelled"
    log = check_log(db, tid)
    types = [e["type"] for e in log]
    assert types[-1] == "response.cancelled"
    assert [t for t in types if t in TERMINAL_EVENT_TYPES] == ["response.cancelled"]
    assert log[-1]["data"]["response"]["status"] == "cancelled"
    assert task_row(db, tid)["state"] == "cancelled"
    response = response_row(db, task_row(db, tid)["response_id"])
    assert response["incomplete_reason"] is None


def test_cancel_after_completion_changes_nothing(db):
    tid = make_task(db, "completed")
    before = dump(db)
    committed = rules.request_cancel(db, tid)
    assert not committed.changed and committed.events == []
    assert committed.task.state == "completed"
    assert dump(db) == before


@pytest.mark.parametrize(
    "state,via", [("completed", ""), ("failed", ""), ("cancelled", "queued"), ("cancelled", "")]
)
def test_terminal_states_never_change_again(db, state, via):
    tid = make_task(db, state, via=via or "running")
    before = dump(db)
    attempts = [
        lambda: rules.finish(db, tid, rules.Outcome("completed", usage=usage())),
        lambda: rules.finish(db, tid, rules.Outcome("failed", error={"code": "x"})),
        lambda: rules.finish(db, tid, rules.Outcome("cancelled")),
        lambda: rules.request_cancel(db, tid),
        lambda: rules.request_cancel(db, tid),
        lambda: rules.append_output(db, tid, [1], "more"),
        lambda: rules.start_running(db, tid, input_tokens=1),
        lambda: rules.append_events(db, tid, loading_events, to_state="loading"),
        lambda: rules.append_events(db, tid, lambda t, r: [{"type": "x"}], to_state="queued"),
    ]
    for attempt in attempts:
        committed = attempt()
        assert not committed.changed and committed.events == []
        assert dump(db) == before
    check_log(db, tid)


@pytest.mark.parametrize("to_state", ["queued", "loading", "running"])
def test_cancelling_task_cannot_be_moved_back_and_then_complete(db, to_state):
    """Once a cancel is accepted no rule function may take the task out of `cancelling` except
    into `cancelled`; otherwise a later finish(completed) would complete a cancelled task."""
    tid = make_task(db, "cancelling")
    before = dump(db)
    committed = rules.append_events(
        db, tid, lambda t, r: [{"type": "response.in_progress"}], to_state=to_state
    )
    assert not committed.changed
    assert dump(db) == before
    rules.finish(db, tid, rules.Outcome("completed", usage=usage()))
    assert task_row(db, tid)["state"] == "cancelled"
    assert types_of(db, tid)[-1] == "response.cancelled"
    check_log(db, tid)


# ---------------------------------------------------------------------------------------------
# 4. SHOULD keep finished tasks and their events for a configurable retention period


def _age(db, task_ids, finished_ago, now):
    """Make tasks look finished `finished_ago` seconds before `now` (created a minute earlier)."""
    conn = raw(db)
    try:
        for tid in task_ids:
            stamp = now - finished_ago
            conn.execute(
                "UPDATE tasks SET finished_at = ?, created_at = ?, updated_at = ? WHERE id = ?",
                (stamp, stamp - 60, stamp, tid),
            )
    finally:
        conn.close()


def _rows_of(db, task_ids):
    conn = raw(db)
    try:
        out = {}
        for tid in task_ids:
            task = conn.execute("SELECT * FROM tasks WHERE id = ?", (tid,)).fetchone()
            out[tid] = (
                tuple(task) if task else None,
                [
                    tuple(r)
                    for r in conn.execute(
                        "SELECT * FROM task_events WHERE task_id = ? ORDER BY id", (tid,)
                    )
                ],
                [
                    tuple(r)
                    for r in conn.execute("SELECT * FROM responses WHERE task_id = ?", (tid,))
                ],
            )
        return out
    finally:
        conn.close()


def test_retention_deletes_old_finished_tasks_and_keeps_young_ones(db):
    now = time.time()
    retention = 7 * DAY
    old = [
        make_task(db, "completed"),
        make_task(db, "failed"),
        make_task(db, "cancelled"),
        make_task(db, "cancelled", via="queued"),
    ]
    young = [
        make_task(db, "completed"),
        make_task(db, "failed"),
        make_task(db, "cancelled", via="queued"),
    ]
    edge_old, edge_young = make_task(db, "completed"), make_task(db, "completed")
    _age(db, old, 30 * DAY, now)
    _age(db, young, 6 * DAY, now)
    _age(db, [edge_old], retention + 1, now)
    _age(db, [edge_young], retention - 1, now)
    gone = [*old, edge_old]
    kept = [*young, edge_young]
    gone_events = sum(len(events_of(db, t)) for t in gone)
    kept_before = _rows_of(db, kept)
    now_keys = [
        IdempotencyKey(
            caller="owner",
            key=f"k{i}",
            request_digest="d",
            created_at=now - 2 * DAY,
            expires_at=now + (-DAY if i % 2 else DAY),
        )
        for i in range(4)
    ]
    for key in now_keys:
        task, response = new_task()
        rules.create_task(db, task, response, idempotency=key)

    report = rules.purge_expired(db, retention, now=now)

    assert (report.tasks, report.responses, report.events) == (len(gone), len(gone), gone_events)
    after = _rows_of(db, gone)
    for tid in gone:
        assert after[tid] == (None, [], []), tid  # the task, its events and its response
    assert _rows_of(db, kept) == kept_before  # untouched, events and responses included
    keys = [r[0] for r in query(db, "SELECT key FROM idempotency_keys ORDER BY key")]
    assert keys == ["k0", "k2"] and report.idempotency_keys == 2
    # No orphans anywhere.
    orphans = "SELECT COUNT(*) FROM {} WHERE task_id NOT IN (SELECT id FROM tasks)"
    assert query(db, orphans.format("task_events")) == [(0,)]
    assert query(db, orphans.format("responses")) == [(0,)]


def test_retention_period_is_configurable(db):
    now = time.time()
    tid = make_task(db, "completed")
    _age(db, [tid], 3 * DAY, now)
    assert rules.purge_expired(db, 7 * DAY, now=now).tasks == 0
    assert task_row(db, tid) is not None
    assert rules.purge_expired(db, 2 * DAY, now=now).tasks == 1
    assert task_row(db, tid) is None and events_of(db, tid) == []


# ---------------------------------------------------------------------------------------------
# 5. MUST NOT delete unfinished tasks when it cleans up records


def test_purge_never_deletes_unfinished_tasks_however_old(db):
    unfinished = [make_task(db, s) for s in UNFINISHED]
    unfinished.append(make_task(db, "cancelling", via="loading"))
    bogus = [make_task(db, s) for s in UNFINISHED]
    finished = make_task(db, "completed")
    conn = raw(db)
    conn.execute("UPDATE tasks SET created_at = 1000, updated_at = 1000 WHERE state != 'completed'")
    # Even a finished_at that should never be there (a bug, a hand edit) must not matter.
    conn.executemany(
        "UPDATE tasks SET finished_at = 1000 WHERE id = ?", [(t,) for t in [*bogus, finished]]
    )
    conn.close()
    keep = [*unfinished, *bogus]
    before = _rows_of(db, keep)

    report = rules.purge_expired(db, retention_seconds=0, now=time.time() + 3650 * DAY)

    assert _rows_of(db, keep) == before
    assert report.tasks == 1 and task_row(db, finished) is None  # the purge did run
    for tid in keep:
        check_log(db, tid)


# ---------------------------------------------------------------------------------------------
# 6. MUST, at start-up, examine the tasks left queued, loading, running and cancelling


def test_recovery_examines_every_leftover_task(db_url):
    db = open_db(db_url)
    leftover = {}
    for state in UNFINISHED:
        for policy in POLICIES:
            leftover.update({t: (state, policy) for t in make_tasks(db, 3, state, policy)})
    terminal = [make_task(db, s) for s in ("completed", "failed", "cancelled")]
    db.dispose()

    restarted = open_db(db_url)  # a new process on the same file
    try:
        report = rules.recover_at_startup(restarted)
        assert report.examined == len(leftover)
        for tid, (state, policy) in leftover.items():
            row = task_row(restarted, tid)
            check_log(restarted, tid)
            # Every leftover task was looked at: none keeps a state its policy does not allow.
            if policy == "fail":
                assert row["state"] == ("cancelled" if state == "cancelling" else "failed")
            assert row["state"] not in ("loading", "cancelling")
            if row["state"] == "running":
                assert policy == "resume" and state == "running"
        assert sum(report.transitions.values()) == len(leftover)
        for tid in terminal:
            check_log(restarted, tid)
    finally:
        restarted.dispose()


# ---------------------------------------------------------------------------------------------
# concurrency that SQLite's one write lock settles by itself, and PostgreSQL by row and
# advisory locks (the `db` fixture runs each test on both backends)


def test_concurrent_claims_of_one_idempotency_key_make_one_claim(db):
    from jupyter_lmsp.store import idempotency

    n = 8
    barrier = threading.Barrier(n)
    kinds: list[str] = []
    errors: list[BaseException] = []

    def claim() -> None:
        try:
            barrier.wait(10)
            kinds.append(idempotency.claim_key(db, "owner", "key-1", "sha256:x", DAY).kind)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=claim) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors[:1]
    assert sorted(kinds) == ["in_use"] * (n - 1) + ["new"]


def test_concurrent_creates_of_one_owner_never_overshoot_its_quota(db):
    from jupyter_lmsp.auth.scopes import Caller
    from jupyter_lmsp.protocol.errors import LMSPError
    from jupyter_lmsp.services.admission import Admission

    admission = Admission(max_tasks=5, max_tokens=10_000)
    caller = Caller(id="client_q", scopes=frozenset({"responses:write"}))
    n = 12
    barrier = threading.Barrier(n)
    outcomes: list[str] = []

    def create() -> None:
        task, response = new_task()
        task.owner = response.owner = caller.id
        task.params = json.dumps({"budget": 100})
        check = admission.quota(caller, 100)
        barrier.wait(10)
        try:
            rules.create_task(db, task, response, admit=check)
            outcomes.append("created")
        except LMSPError as exc:
            outcomes.append(exc.code)

    threads = [threading.Thread(target=create) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    admission.close()
    assert sorted(outcomes) == ["created"] * 5 + ["too_many_tasks"] * (n - 5)
    assert query(db, "SELECT count(*) FROM tasks WHERE owner = 'client_q'") == [(5,)]


def test_in_progress_lists_only_items_already_added(db):
    """An attempt's `response.in_progress` is committed with the output as it was before the
    attempt's messages open: every item in a lifecycle snapshot had its `output_item.added`
    first (the openai SDKs' stream helpers count an item from that event)."""
    tid = make_task(db, "queued")
    to_loading(db, tid)
    rules.start_running(db, tid, input_tokens=3)
    added: set[str] = set()
    for data in (row["data"] for row in events_of(db, tid)):
        if data["type"] == ev.ITEM_ADDED:
            added.add(data["item"]["id"])
        elif "response" in data:
            listed = {item["id"] for item in data["response"]["output"]}
            assert listed <= added, (data["type"], listed - added)
    assert added, "the attempt opened its message"
