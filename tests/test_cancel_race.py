"""LMSP section 11.2, "the cancellation transition is atomic": a cancel racing a completion.

Two real threads, released together by a `threading.Barrier` round after round, against one
real SQLite file: one calls `request_cancel`, the other `finish(completed)` (or appends output
and then finishes) on the same `running` task. Whatever the interleaving, every round must end
with exactly one terminal state (completed or cancelled) and exactly one terminal event, last in
a log whose sequence numbers run from 0 without a gap; a log that says `response.cancelling`
never ends in anything but `response.cancelled` (never "cancelled, then completed"); and what
each call returned is what was committed (a refused cancel returns `changed=False` and the task
completed; an accepted one made the task end cancelled).

The counts of each ending are printed (run with `-s` to see them) and both endings must occur,
or the test would not be racing anything.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections import Counter
from pathlib import Path

import pytest
from storehelpers import (
    OUTPUT,
    OUTPUT_TEXT,
    TERMINAL_EVENT_TYPES,
    check_log,
    db_path,
    events_of,
    make_tasks,
    open_db,
    response_row,
    task_row,
    usage,
)

from jupyter_lmsp.store import rules

ROUNDS = 1000
BATCH = 250

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def db(db_url):
    database = open_db(db_url)
    yield database
    database.dispose()


def _race(db, task_ids, left, right):
    """Run `left(tid)` and `right(tid)` on two threads, started together for every task.

    Returns, per task, what each side returned."""
    barrier = threading.Barrier(2)
    results = {"left": {}, "right": {}}
    errors = []

    def worker(side, fn):
        try:
            for tid in task_ids:
                barrier.wait(30)
                results[side][tid] = fn(tid)
        except threading.BrokenBarrierError:
            pass
        except BaseException as exc:
            path = Path(db_path(db))
            where = (
                sorted(p.name for p in path.parent.iterdir())
                if not db.is_postgres and path.parent.exists()
                else None
            )
            errors.append((side, f"files {where}\n" + "".join(traceback.format_exception(exc))))
            barrier.abort()

    threads = [
        threading.Thread(target=worker, args=("left", left), daemon=True),
        threading.Thread(target=worker, args=("right", right), daemon=True),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[0][1]
    assert all(not t.is_alive() for t in threads)
    return results["left"], results["right"]


def _check_round(db, tid, base_count, cancel_result):
    """The invariants of one round; returns how it ended."""
    log = check_log(db, tid)  # contiguous from 0, next_sequence == count, state ⇔ last event
    types = [e["type"] for e in log]
    state = task_row(db, tid)["state"]
    assert state in ("completed", "cancelled"), state
    terminal = [i for i, t in enumerate(types) if t in TERMINAL_EVENT_TYPES]
    assert terminal == [len(types) - 1], types
    expected_terminal = "response.completed" if state == "completed" else "response.cancelled"
    assert types[-1] == expected_terminal
    cancelling = [i for i, t in enumerate(types) if t == "response.cancelling"]
    if cancelling:
        # Once a cancel is in the log, the only ending is `cancelled`: never completed after it.
        assert len(cancelling) == 1 and state == "cancelled", types
        assert "response.completed" not in types and "response.incomplete" not in types
    # The cancel's answer agrees with the log: accepted iff the task ended cancelled.
    if state == "completed":
        assert not cancel_result.changed and cancel_result.events == []
        assert cancel_result.task.state == "completed"
        assert not cancelling
    else:
        assert cancel_result.changed
        assert [e["type"] for e in cancel_result.events] == ["response.cancelling"]
        assert cancel_result.events[0]["sequence_number"] == cancelling[0]
    # Nothing was lost or duplicated between the two writers.
    assert len(log) > base_count
    return state, log


def _make_running(db, n):
    ids = []
    for start in range(0, n, BATCH):
        ids += make_tasks(db, min(BATCH, n - start), "running", "resume")
    return ids


def test_cancel_races_finish(db):
    t0 = time.monotonic()
    ids = _make_running(db, ROUNDS)
    base = {tid: len(events_of(db, tid)) for tid in ids}
    made = time.monotonic()

    cancels, finishes = _race(
        db,
        ids,
        lambda tid: rules.request_cancel(db, tid),
        lambda tid: rules.finish(db, tid, rules.Outcome("completed", usage=usage())),
    )

    outcomes = Counter()
    for tid in ids:
        state, log = _check_round(db, tid, base[tid], cancels[tid])
        outcomes[state] += 1
        fin = finishes[tid]
        # finish always wrote the terminal event (directly, or as `cancelled` after a cancel).
        assert fin.changed and fin.task.state == state
        assert fin.events[-1] == log[-1]["data"]
        # The two calls' events, together, are exactly what the round appended.
        appended = [e["data"] for e in log[base[tid] :]]
        ours = sorted(cancels[tid].events + fin.events, key=lambda e: e["sequence_number"])
        assert ours == appended
        response = response_row(db, task_row(db, tid)["response_id"])
        assert response["completed_at"] is not None
    print(
        f"\ncancel vs finish: {ROUNDS} rounds: {outcomes['completed']} completed, "
        f"{outcomes['cancelled']} cancelled "
        f"(setup {made - t0:.1f}s, race {time.monotonic() - made:.1f}s)"
    )
    assert sum(outcomes.values()) == ROUNDS
    assert outcomes["completed"] > 0 and outcomes["cancelled"] > 0, outcomes


def test_cancel_races_output_then_finish(db):
    t0 = time.monotonic()
    ids = _make_running(db, ROUNDS)
    base = {tid: len(events_of(db, tid)) for tid in ids}
    made = time.monotonic()

    def generate(tid):
        out = [rules.append_output(db, tid, [21], " more"), rules.append_output(db, tid, [22], "!")]
        out.append(rules.finish(db, tid, rules.Outcome("completed", usage=usage())))
        return out

    cancels, runs = _race(db, ids, lambda tid: rules.request_cancel(db, tid), generate)

    outcomes = Counter()
    cancel_positions = Counter()
    for tid in ids:
        state, log = _check_round(db, tid, base[tid], cancels[tid])
        outcomes[state] += 1
        types = [e["type"] for e in log]
        # Both deltas made it into the log (a cancelling task still takes output), once each.
        deltas = [e["data"]["delta"] for e in log if e["type"] == "response.output_text.delta"]
        assert deltas[-2:] == [" more", "!"] and len(deltas) == len(OUTPUT) + 2
        text = OUTPUT_TEXT + " more!"
        done = [e for e in log if e["type"] == "response.output_text.done"]
        assert [e["data"]["text"] for e in done] == [text]
        status = "completed" if state == "completed" else "incomplete"
        assert log[-1]["data"]["response"]["output"][0]["status"] == status
        assert log[-1]["data"]["response"]["output"][0]["content"][0]["text"] == text
        # Every event a call returned is in the log at the number it was given, and together
        # they are exactly what the round appended.
        returned = [e for c in [cancels[tid], *runs[tid]] for e in c.events]
        appended = [e["data"] for e in log[base[tid] :]]
        assert sorted(returned, key=lambda e: e["sequence_number"]) == appended
        if "response.cancelling" in types:
            cancel_positions[types.index("response.cancelling") - base[tid]] += (
                1  # 0: before both deltas, 1: between, 2: after them
            )
    print(
        f"\ncancel vs output+finish: {ROUNDS} rounds: {outcomes['completed']} completed, "
        f"{outcomes['cancelled']} cancelled; cancel landed after 0/1/2 deltas: "
        f"{cancel_positions[0]}/{cancel_positions[1]}/{cancel_positions[2]} "
        f"(setup {made - t0:.1f}s, race {time.monotonic() - made:.1f}s)"
    )
    assert sum(outcomes.values()) == ROUNDS
    assert outcomes["completed"] > 0 and outcomes["cancelled"] > 0, outcomes
