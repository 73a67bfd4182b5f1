"""Runners with leases (LMSP B12): who drives a task, and recovery per dead runner.

What these tests prove, against a real SQLite file and real processes:

- a runner registers with its host, boot, process id and start time, renews its lease, and
  gives it up; a renewal after another process recovered it says so;
- on this machine a runner is gone exactly when its process is (a dead process at once, with
  its lease still running; a reused process id is told apart by its start time; a live process
  is never gone, however late its heartbeat); elsewhere, when its lease expired;
- start-up recovery applies every cell of the 11.3 table to a dead runner's tasks, hands the
  survivors to the recovering runner, deletes the dead runner, releases only its idempotency
  claims — and leaves every task and claim of a live runner exactly as it was;
- a lease renewed between the sweep's look and its transaction, or a second server recovering
  the same runner at the same time, leads to one recovery, never two;
- a runner cannot write to a task another runner holds (claim, start, text, end): it is told
  the task is lost and nothing changes; anyone may cancel it; a finished task is nobody's;
- tasks of a runner that stopped cleanly are nobody's, and the next recovery adopts them;
- the lease's heartbeat renews it and sweeps for dead runners; a runner that finds its lease
  gone registers again.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import psutil
import pytest
from sqlalchemy import insert
from storehelpers import (
    OUTPUT,
    POLICIES,
    TABLE,
    UNFINISHED,
    check_log,
    dump,
    loading_events,
    make_task,
    new_task,
    open_db,
    query,
    raw,
    task_row,
    types_of,
)

from jupyter_lmsp.store import idempotency, rules, runners
from jupyter_lmsp.store.tables import Runner


@pytest.fixture
def db(db_url):
    database = open_db(db_url)
    yield database
    database.dispose()


@pytest.fixture
def sleeper():
    """A live process of our own (a stand-in for another server on this machine)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    yield proc
    proc.kill()
    proc.wait()


def _dead_process() -> tuple[int, float]:
    """The id and start time of a process that ran here and has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    started = psutil.Process(proc.pid).create_time()
    proc.kill()
    proc.wait()
    return proc.pid, started


def _runner(
    db,
    pid: int,
    started: float,
    *,
    elsewhere: bool = False,
    lease_left: float = 1000.0,
) -> str:
    """Register a runner row as the process `pid` (started at `started`) would."""
    here = runners.this_process()
    now = time.time()
    row = Runner(
        id=f"runner_{pid}_{int(started * 1000)}_{elsewhere}",
        kind="server",
        host="some-other-machine" if elsewhere else here.host,
        boot_id="another-boot" if elsewhere else here.boot_id,
        pid=pid,
        process_started_at=started,
        started_at=now,
        heartbeat_at=now,
        lease_expires_at=now + lease_left,
    )
    with db.writing() as conn:
        conn.execute(insert(Runner.__table__), row.model_dump())
    return row.id


def _hold(db, task_ids, runner_id) -> None:
    conn = raw(db)
    try:
        conn.executemany(
            "UPDATE tasks SET runner_id = ? WHERE id = ?", [(runner_id, t) for t in task_ids]
        )
    finally:
        conn.close()


def _row(db, runner_id):
    rows = query(db, "SELECT * FROM runners WHERE id = ?", (runner_id,))
    return rows[0] if rows else None


# ---------------------------------------------------------------------------------------------
# registration and leases


def test_a_runner_registers_renews_and_gives_up_its_lease(db):
    me = runners.this_process()
    runner = runners.register(db, label="test", lease_seconds=30)
    row = _row(db, runner.id)
    assert row is not None
    stored = runners.list_runners(db)[0]
    assert (stored.host, stored.boot_id, stored.pid) == (me.host, me.boot_id, me.pid)
    assert abs(stored.process_started_at - me.started_at) < 1e-6
    assert stored.lease_expires_at == pytest.approx(time.time() + 30, abs=2)
    assert runners.gone_reason(stored, time.time()) is None  # this very process

    time.sleep(0.01)
    assert runners.renew(db, runner.id, 60)
    renewed = runners.list_runners(db)[0]
    assert renewed.heartbeat_at > stored.heartbeat_at
    assert renewed.lease_expires_at == pytest.approx(time.time() + 60, abs=2)

    runners.unregister(db, runner.id)
    assert runners.list_runners(db) == []
    assert not runners.renew(db, runner.id, 60)  # someone recovered it: the lease is lost


def test_a_dead_process_on_this_machine_is_gone_at_once(db, sleeper):
    alive = _runner(db, sleeper.pid, psutil.Process(sleeper.pid).create_time())
    pid, started = _dead_process()
    dead = _runner(db, pid, started)  # its lease runs for another 1000 s
    gone = {r.id: why for r, why in runners.gone_runners(db)}
    assert gone == {dead: "process_gone"}
    assert alive not in gone


def test_a_reused_process_id_is_not_the_runner(db, sleeper):
    started = psutil.Process(sleeper.pid).create_time()
    # A runner that had the same id as this live process, but started an hour earlier.
    old = _runner(db, sleeper.pid, started - 3600)
    assert {r.id: why for r, why in runners.gone_runners(db)} == {old: "process_gone"}


def test_a_live_process_on_this_machine_is_never_gone_even_with_its_lease_expired(db, sleeper):
    _runner(db, sleeper.pid, psutil.Process(sleeper.pid).create_time(), lease_left=-3600)
    assert runners.gone_runners(db) == []


def test_a_runner_elsewhere_is_gone_when_its_lease_expired(db):
    fresh = _runner(db, 4242, 1000.0, elsewhere=True, lease_left=30)
    stale = _runner(db, 4343, 1000.0, elsewhere=True, lease_left=-1)
    gone = {r.id: why for r, why in runners.gone_runners(db)}
    assert gone == {stale: "lease_expired"}
    assert fresh not in gone
    # ...and it is gone once its lease runs out.
    later = time.time() + 31
    assert {r.id for r, _ in runners.gone_runners(db, later)} == {fresh, stale}


# ---------------------------------------------------------------------------------------------
# recovery per dead runner


def _tasks_in_every_cell(db) -> dict[str, tuple[str, str]]:
    made = {}
    for state in UNFINISHED:
        for policy in POLICIES:
            made[make_task(db, state, policy)] = (state, policy)
    return made


def test_recovery_applies_the_table_to_a_dead_runners_tasks_and_never_to_a_live_ones(db, sleeper):
    me = runners.register(db, lease_seconds=30).id
    other = _runner(db, sleeper.pid, psutil.Process(sleeper.pid).create_time())
    pid, started = _dead_process()
    dead = _runner(db, pid, started)
    dead_tasks = _tasks_in_every_cell(db)
    live_tasks = _tasks_in_every_cell(db)
    _hold(db, dead_tasks, dead)
    _hold(db, live_tasks, other)
    now = time.time()
    for key in ("dead-claim", "live-claim", "dead-done"):
        claim = idempotency.claim_key(
            db,
            "jupyter:alice",
            key,
            "d",
            3600,
            runner_id=dead if key.startswith("dead") else other,
        )
        if key == "dead-done":
            idempotency.complete_key(db, idempotency.finished_row(claim.row, 200, {"ok": 1}))
    live_before = {t: (task_row(db, t), types_of(db, t)) for t in live_tasks}
    live_claim = query(db, "SELECT * FROM idempotency_keys WHERE key = 'live-claim'")

    report = rules.recover_at_startup(db, adopter=me, now=now)

    assert report.runners == [(dead, "process_gone")]
    assert report.examined == len(dead_tasks)
    assert report.released_claims == 1
    for tid, (state, policy) in dead_tasks.items():
        row = task_row(db, tid)
        assert row["state"] == TABLE[(state, policy)], (state, policy)
        check_log(db, tid)
        if row["state"] in ("queued", "running"):
            assert row["runner_id"] == me and tid in report.adopted  # the survivor is ours
        else:
            assert row["runner_id"] is None  # finished: nobody's
        if row["state"] == "failed":
            assert '"server_restarted"' in row["error"]
    # The live runner's tasks and claim: exactly as they were.
    for tid, before in live_before.items():
        assert (task_row(db, tid), types_of(db, tid)) == before
    assert query(db, "SELECT * FROM idempotency_keys WHERE key = 'live-claim'") == live_claim
    keys = {k for (k,) in query(db, "SELECT key FROM idempotency_keys")}
    assert keys == {"live-claim", "dead-done"}
    # The dead runner is gone from the table; the others are there.
    assert {r.id for r in runners.list_runners(db)} == {me, other}

    # A second sweep finds nothing to do.
    again = rules.recover_at_startup(db, adopter=me)
    assert again.examined == 0 and again.runners == []


def test_a_lease_renewed_before_the_recovery_commits_leaves_the_runner_alone(db):
    remote = _runner(db, 4242, 1000.0, elsewhere=True, lease_left=-1)
    task = make_task(db, "running", "fail")
    _hold(db, [task], remote)
    (found, why), *_ = runners.gone_runners(db)
    assert (found.id, why) == (remote, "lease_expired")
    assert runners.renew(db, remote, 30)  # its heartbeat comes in meanwhile

    report = rules.recover_runner(db, remote, adopter=None)

    assert report.examined == 0 and report.runners == []
    assert task_row(db, task)["state"] == "running"
    assert _row(db, remote) is not None


def test_two_servers_recovering_the_same_dead_runner_recover_it_once(db):
    pid, started = _dead_process()
    dead = _runner(db, pid, started)
    tasks = _tasks_in_every_cell(db)
    _hold(db, tasks, dead)
    adopters = [runners.register(db, lease_seconds=30).id for _ in range(2)]
    barrier = threading.Barrier(2)
    reports: list[rules.RecoveryReport] = []

    def sweep(adopter: str) -> None:
        barrier.wait()
        reports.append(rules.recover_runner(db, dead, adopter))

    threads = [threading.Thread(target=sweep, args=(a,)) for a in adopters]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r.examined for r in reports) == [0, len(tasks)]
    (winner,) = [r for r in reports if r.examined]
    holders = {task_row(db, t)["runner_id"] for t in winner.adopted}
    assert len(holders) == 1 and holders <= set(adopters)
    for tid in tasks:
        log = check_log(db, tid)
        assert sum(e["type"] == "response.queued" for e in log) <= 1


def test_tasks_of_a_runner_that_stopped_cleanly_are_adopted_by_the_next_recovery(db):
    gone = runners.register(db, lease_seconds=30).id
    tasks = _tasks_in_every_cell(db)
    _hold(db, tasks, gone)
    runners.unregister(db, gone)  # a clean shutdown
    assert {task_row(db, t)["runner_id"] for t in tasks} == {None}  # the key's SET NULL

    me = runners.register(db, lease_seconds=30).id
    report = rules.recover_at_startup(db, adopter=me)
    assert report.runners == [(None, "unheld")]
    assert report.examined == len(tasks)
    for tid, (state, policy) in tasks.items():
        assert task_row(db, tid)["state"] == TABLE[(state, policy)]


# ---------------------------------------------------------------------------------------------
# only the holder drives a task


def test_a_runner_cannot_write_to_a_task_another_runner_holds(db):
    mine = runners.register(db, lease_seconds=30).id
    theirs = runners.register(db, lease_seconds=30).id
    queued = make_task(db, "queued", "resume")
    running = make_task(db, "running", "resume")
    loading = make_task(db, "loading", "resume")
    _hold(db, [queued, running, loading], theirs)
    before = dump(db)

    claimed = rules.append_events(
        db, queued, loading_events, to_state="loading", only_from=["queued"], runner_id=mine
    )
    started = rules.start_running(db, loading, 3, runner_id=mine)
    (text,) = rules.append_outputs(db, {running: OUTPUT[0]}, runner_id=mine)
    ended = rules.finish(db, running, rules.Outcome("completed"), runner_id=mine)

    assert all(c.lost and not c.changed and not c.events for c in (claimed, started, text, ended))
    assert dump(db) == before
    # The holder can; and anyone can cancel.
    assert rules.append_output(db, running, *OUTPUT[1], runner_id=theirs).events
    assert rules.request_cancel(db, loading).task.state == "cancelling"
    check_log(db, running)
    check_log(db, loading)


def test_a_finished_task_is_nobodys(db):
    mine = runners.register(db, lease_seconds=30).id
    task, response = new_task("resume")
    task.runner_id = mine
    rules.create_task(db, task, response)
    assert task_row(db, task.id)["runner_id"] == mine
    rules.request_cancel(db, task.id)  # queued → cancelled at once
    assert task_row(db, task.id)["runner_id"] is None


# ---------------------------------------------------------------------------------------------
# the lease's heartbeat and sweep (services.lease)


def test_a_heartbeat_renews_the_lease_and_the_sweep_recovers_dead_runners(db):
    from jupyter_lmsp.services.lease import RunnerLease

    lease = RunnerLease(db, lease_seconds=30, heartbeat_interval=1)
    me = lease.register()
    pid, started = _dead_process()
    dead = _runner(db, pid, started)
    tasks = _tasks_in_every_cell(db)
    _hold(db, tasks, dead)
    before = _row(db, me)

    time.sleep(0.01)
    report = lease.beat()

    assert _row(db, me)[8] > before[8]  # heartbeat_at moved
    assert report.runners == [(dead, "process_gone")] and report.examined == len(tasks)
    for tid in report.adopted:
        assert task_row(db, tid)["runner_id"] == me
    assert lease.beat().runners == []  # nothing more to do


def test_a_runner_that_lost_its_lease_registers_again_and_says_so(db):
    from jupyter_lmsp.services.lease import RunnerLease

    lease = RunnerLease(db, lease_seconds=30, heartbeat_interval=1)
    first = lease.register()
    runners.unregister(db, first)  # another server recovered it meanwhile
    lease.beat()
    assert lease.runner_id != first and _row(db, lease.runner_id) is not None
    assert _row(db, first) is None
    lease.stop()
    assert _row(db, lease.runner_id) is None  # a clean stop gives the lease up
