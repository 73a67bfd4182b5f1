"""LMSP section 11.3: recovery at start-up, every cell of the table, against a real SQLite file.

What these tests prove:

- each of the twelve cells (state found × `on_restart`) moves the task to the state the table
  names, written out literally below, not imported from the code under test;
- a task that moves to `failed` carries error code `server_restarted` (in the task, in the
  stored response and in the response object of its one `response.failed` event); a task that
  moves to `cancelled` gets one `response.cancelled` event; a task that stays or goes back to
  `queued` gets no terminal event; `running` + `resume` stays `running` with its snapshot
  (token ids, text) and its log untouched, and the runner continues it without a gap;
- the new state and its event are committed together (the last event has sequence
  `next_sequence - 1` and matches the state), logs stay contiguous from 0, and a recovery whose
  transaction fails part-way leaves every task and event exactly as before — nor can another
  connection see a recovery half done;
- terminal tasks are not touched; each terminal task has exactly one terminal event; a second
  start-up changes nothing; and all of it holds for many mixed tasks at once.

Every recovery runs on a `Database` opened afresh on the file, as a restarted process would.
"""

from __future__ import annotations

import json

import pytest
from storehelpers import (
    INTEGRITY_ERRORS,
    OUTPUT_TEXT,
    OUTPUT_TOKENS,
    POLICIES,
    TABLE,
    TERMINAL,
    TERMINAL_EVENT_TYPES,
    UNFINISHED,
    check_log,
    dump,
    events_of,
    in_thread,
    make_task,
    make_tasks,
    open_db,
    open_pausing_db,
    query,
    raw,
    response_row,
    task_row,
    types_of,
    usage,
    write_lock_is_held,
)

from jupyter_lmsp.store import rules


@pytest.fixture
def store(db_url):
    """`make(...)` builds tasks before the "crash"; `restart()` disposes that store and opens
    a new one on the same file, as the next process would."""

    class Store:
        def __init__(self):
            self.db = open_db(db_url)

        def restart(self):
            self.db.dispose()
            self.db = open_db(db_url)
            return self.db

    s = Store()
    yield s
    s.db.dispose()


def _assert_recovered(db, tid, found, policy, before_events, before_task):
    """Everything 11.3 asks of one recovered task."""
    expected = TABLE[(found, policy)]
    row = task_row(db, tid)
    log = check_log(db, tid)  # contiguous from 0; next_sequence == count; last event ⇔ state
    types = [e["type"] for e in log]
    assert row["state"] == expected, (found, policy, row["state"])
    # Recovery only appends: what was in the log before is still there, unchanged.
    assert log[: len(before_events)] == before_events
    added = log[len(before_events) :]
    assert row["next_sequence"] == len(log)
    if added:
        assert log[-1]["sequence_number"] == row["next_sequence"] - 1
    terminal = [t for t in types if t in TERMINAL_EVENT_TYPES]

    if expected == "failed":
        assert terminal == ["response.failed"] and types[-1] == "response.failed"
        assert json.loads(row["error"])["code"] == "server_restarted"
        event_response = log[-1]["data"]["response"]
        assert event_response["status"] == "failed"
        assert event_response["error"]["code"] == "server_restarted"
        stored = response_row(db, row["response_id"])
        assert json.loads(stored["error"])["code"] == "server_restarted"
        assert row["finished_at"] is not None
    elif expected == "cancelled":
        assert terminal == ["response.cancelled"] and types[-1] == "response.cancelled"
        assert log[-1]["data"]["response"]["status"] == "cancelled"
        assert row["error"] is None
        assert row["finished_at"] is not None
    elif expected == "queued":
        assert terminal == []
        assert row["finished_at"] is None
        if found != "queued":
            # It went back to the queue: the log says so, with the state, in one commit.
            assert added and added[-1]["type"] == "response.queued"
            assert added[-1]["data"]["response"]["status"] == "queued"
        # A run interrupted and taken up again counts as an attempt; one never started not.
        assert row["attempts"] == before_task["attempts"] + (found != "queued")
    else:  # running + resume: still running, continuing from its snapshot
        assert (found, policy) == ("running", "resume")
        assert terminal == []
        assert added == []
        # The same row, but for its count of attempts (and when that was written).
        changed = {"attempts", "updated_at"}
        assert {k: v for k, v in row.items() if k not in changed} == {
            k: v for k, v in before_task.items() if k not in changed
        }
        assert row["attempts"] == before_task["attempts"] + 1 == 1
        snapshot = json.loads(row["snapshot"])
        assert snapshot["token_ids"] == OUTPUT_TOKENS
        assert snapshot["text"] == OUTPUT_TEXT
        assert snapshot["open"] is True
    return row, log


@pytest.mark.parametrize("found,policy", list(TABLE), ids=[f"{s}-{p}" for s, p in TABLE])
def test_recovery_table_cell(store, found, policy):
    tid = make_task(store.db, found, policy)
    other = make_task(store.db, "completed", policy)
    before_events = events_of(store.db, tid)
    before_task = task_row(store.db, tid)
    before_other = (task_row(store.db, other), events_of(store.db, other))

    db = store.restart()
    report = rules.recover_at_startup(db)

    assert report.examined == 1
    assert report.transitions == {f"{found}->{TABLE[(found, policy)]}": 1}
    _assert_recovered(db, tid, found, policy, before_events, before_task)
    check_log(db, other)
    assert (task_row(db, other), events_of(db, other)) == before_other
    # What recover_at_startup reports as committed is what is in the log.
    changed = [c for c in report.committed if c.task.id == tid]
    tail = [e["data"] for e in events_of(db, tid)[len(before_events) :]]
    assert [e for c in changed for e in c.events] == tail


@pytest.mark.parametrize("policy", POLICIES)
def test_cancelling_from_loading_is_cancelled(store, policy):
    tid = make_task(store.db, "cancelling", policy, via="loading")
    before_events, before_task = events_of(store.db, tid), task_row(store.db, tid)
    rules.recover_at_startup(store.restart())
    _assert_recovered(store.db, tid, "cancelling", policy, before_events, before_task)


def test_resumed_task_continues_its_log_and_text_without_a_gap(store):
    tid = make_task(store.db, "running", "resume")
    count = len(events_of(store.db, tid))
    db = store.restart()
    rules.recover_at_startup(db)
    # The runner re-enters the open message: nothing is appended, the snapshot is kept.
    assert rules.start_running(db, tid, input_tokens=3).events == []
    assert len(events_of(db, tid)) == count
    rules.append_output(db, tid, [14], "!")
    rules.finish(db, tid, rules.Outcome("completed", usage=usage()))
    log = check_log(db, tid)
    deltas = "".join(e["data"]["delta"] for e in log if e["type"] == "response.output_text.delta")
    assert deltas == OUTPUT_TEXT + "!"
    done = [e for e in log if e["type"] == "response.output_text.done"]
    assert [e["data"]["text"] for e in done] == [OUTPUT_TEXT + "!"]
    assert json.loads(task_row(db, tid)["snapshot"])["token_ids"] == [*OUTPUT_TOKENS, 14]


def test_requeued_running_task_closes_its_message_and_can_run_again(store):
    tid = make_task(store.db, "running", "retry")
    db = store.restart()
    rules.recover_at_startup(db)
    types = types_of(db, tid)
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.queued",
    ]
    # The next attempt runs to completion with one log, still contiguous.
    rules.append_events(db, tid, lambda t, r: [], to_state="loading", only_from=["queued"])
    rules.start_running(db, tid, input_tokens=3)
    rules.append_output(db, tid, [1], "again")
    rules.finish(db, tid, rules.Outcome("completed", usage=usage()))
    check_log(db, tid)
    assert task_row(db, tid)["state"] == "completed"


@pytest.mark.parametrize("policy", POLICIES)
def test_terminal_tasks_are_untouched_by_recovery(store, policy):
    ids = [
        make_task(store.db, "completed", policy),
        make_task(store.db, "failed", policy),
        make_task(store.db, "cancelled", policy),
        make_task(store.db, "cancelled", policy, via="queued"),
    ]
    before = dump(store.db)
    report = rules.recover_at_startup(store.restart())
    assert report.examined == 0 and report.committed == []
    assert dump(store.db) == before
    for tid in ids:
        log = check_log(store.db, tid)
        assert sum(e["type"] in TERMINAL_EVENT_TYPES for e in log) == 1


def _mixed(db, per_cell):
    """`per_cell` tasks for every cell of the table (cancelling reached from running and from
    loading), terminal tasks of every kind, and tasks without a response (model
    registrations); made by the real rule functions, in batches."""
    cells = {}
    for (found, policy), _ in TABLE.items():
        for tid in make_tasks(db, per_cell, found, policy):
            cells[tid] = (found, policy)
        if found == "cancelling":
            for tid in make_tasks(db, per_cell, found, policy, via="loading"):
                cells[tid] = (found, policy)
    terminal = []
    for state in TERMINAL:
        for policy in POLICIES:
            terminal += make_tasks(db, 2, state, policy)
    terminal += make_tasks(db, 2, "cancelled", "resume", via="queued")
    bare = {}
    for found in UNFINISHED:
        for policy in POLICIES:
            for tid in make_tasks(db, 1, found, policy, with_response=False):
                bare[tid] = (found, policy)
    return cells, terminal, bare


def test_many_mixed_tasks_at_once(store):
    cells, terminal, bare = _mixed(store.db, per_cell=15)
    before_events = {tid: events_of(store.db, tid) for tid in cells}
    before_tasks = {tid: task_row(store.db, tid) for tid in cells}
    before_terminal = {tid: (task_row(store.db, tid), events_of(store.db, tid)) for tid in terminal}

    db = store.restart()
    report = rules.recover_at_startup(db)

    assert report.examined == len(cells) + len(bare)
    expected_transitions = {}
    for found, policy in [*cells.values(), *bare.values()]:
        key = f"{found}->{TABLE[(found, policy)]}"
        expected_transitions[key] = expected_transitions.get(key, 0) + 1
    assert report.transitions == expected_transitions
    for tid, (found, policy) in cells.items():
        _assert_recovered(db, tid, found, policy, before_events[tid], before_tasks[tid])
    for tid in terminal:
        assert (task_row(db, tid), events_of(db, tid)) == before_terminal[tid]
        log = check_log(db, tid)
        assert sum(e["type"] in TERMINAL_EVENT_TYPES for e in log) == 1
    for tid, (found, policy) in bare.items():
        row = task_row(db, tid)
        check_log(db, tid)
        assert row["state"] == TABLE[(found, policy)]
        if row["state"] == "failed":
            assert json.loads(row["error"])["code"] == "server_restarted"
            assert events_of(db, tid)[-1]["data"]["error"]["code"] == "server_restarted"


def test_second_start_up_changes_nothing(store):
    _mixed(store.db, per_cell=2)
    rules.recover_at_startup(store.restart())
    after_first = dump(store.db)
    rows_first = {t[0]: task_row(store.db, t[0]) for t in after_first["tasks"]}
    report = rules.recover_at_startup(store.restart())
    after_second = dump(store.db)
    assert all(c.events == [] for c in report.committed)
    # Nothing changes but the resumed tasks' count of attempts: found running again, their run
    # was interrupted again, and is taken up once more.
    for task_id, first in rows_first.items():
        second = task_row(store.db, task_id)
        resumed = first["state"] == "running"
        assert second["attempts"] == first["attempts"] + resumed
        if resumed:
            first, second = (
                {k: v for k, v in r.items() if k not in ("attempts", "updated_at")}
                for r in (first, second)
            )
        assert first == second
    assert {k: v for k, v in after_second.items() if k != "tasks"} == {
        k: v for k, v in after_first.items() if k != "tasks"
    }


# ---------------------------------------------------------------------------------------------
# the new state and its event in one transaction: a failure part-way leaves everything as it was


def _fail_on_call(monkeypatch, name, n):
    """Make the `n`-th call of `name` (a function the recovery module calls, or `events.write`,
    the one writer of events) raise."""
    module, attr = (rules.events, "write") if name == "events.write" else (rules.recovery, name)
    real = getattr(module, attr)
    calls = {"n": 0}

    def wrapper(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == n:
            raise RuntimeError(f"injected failure in {name} call {n}")
        return real(*args, **kwargs)

    monkeypatch.setattr(module, attr, wrapper)
    return calls


@pytest.mark.parametrize(
    "name,n",
    [
        ("terminate", 1),
        ("terminate", 7),
        ("close_open_item", 9),
        # after the task rows and their events were written, before the responses
        ("save_responses", 1),
        ("events.write", 1),
    ],
)
def test_recovery_failing_part_way_leaves_everything_as_before(store, monkeypatch, name, n):
    _mixed(store.db, per_cell=3)
    before = dump(store.db)
    [(leftover,)] = query(
        store.db,
        "SELECT COUNT(*) FROM tasks WHERE state IN ('queued', 'loading', 'running', 'cancelling')",
    )
    db = store.restart()
    calls = _fail_on_call(monkeypatch, name, n)
    with pytest.raises(RuntimeError, match="injected"):
        rules.recover_at_startup(db)
    assert calls["n"] == n  # it failed after some tasks had already been processed
    assert dump(db) == before
    monkeypatch.undo()
    # Nothing was half-done: the next start-up recovers every task normally.
    report = rules.recover_at_startup(store.restart())
    assert report.examined == leftover
    for (tid,) in query(store.db, "SELECT id FROM tasks"):
        check_log(store.db, tid)


def test_recovery_failing_in_the_database_after_states_were_written_leaves_everything(store):
    """The event rows of all tasks are inserted last, after the state updates were flushed; a
    constraint violation there must take the state updates back too."""
    cells, _, _ = _mixed(store.db, per_cell=2)
    victim = next(t for t, cell in cells.items() if cell == ("cancelling", "fail"))
    nxt = task_row(store.db, victim)["next_sequence"]
    conn = raw(store.db)
    conn.execute(
        "INSERT INTO task_events (task_id, sequence_number, type, data, created_at)"
        " VALUES (?, ?, 'squatter', '{}', 0)",
        (victim, nxt),
    )
    conn.close()
    before = dump(store.db)
    with pytest.raises(INTEGRITY_ERRORS, match=r"(?i)unique"):
        rules.recover_at_startup(store.restart())
    assert dump(store.db) == before


def test_recovery_is_invisible_to_other_connections_until_it_commits(db_url):
    db = open_db(db_url)
    cells, _, _ = _mixed(db, per_cell=2)
    db.dispose()
    pdb = open_pausing_db(db_url)
    try:
        before = dump(pdb)
        with pdb.hold():
            thread, out = in_thread(rules.recover_at_startup, pdb)
            assert pdb.paused.wait(10), out
            assert write_lock_is_held(pdb)
            assert dump(pdb) == before
        thread.join(30)
        assert "error" not in out, out
        for tid, (found, policy) in cells.items():
            assert task_row(pdb, tid)["state"] == TABLE[(found, policy)]
            check_log(pdb, tid)
    finally:
        pdb.dispose()
