"""Several real `jupyter server` processes on one data folder (LMSP B12): owners with leases.

What these tests prove, with real servers, real inference workers and SIGKILL:

- a second server started on the data folder of a running one leaves the first one's tasks
  alone (they finish normally: none failed, none queued again), lists them, streams their
  events as they are committed by the other server, and its cancel reaches the server running
  the task, which stops it;
- when the first server is killed, the second applies the 11.3 table to its tasks at once (it
  sees on this machine that the process is gone: well within the lease), and `resume` tasks
  continue there with the text an uninterrupted run gives, greedy and seeded;
- a server on another machine (as far as the runners table knows) is recovered only once its
  lease expired, and then within the lease timeout;
- two servers, 200 tasks created alternately through both, one of them killed midway (while
  three long tasks of its own, one per restart policy, are surely at work) and started again:
  every task ends exactly once, every event log is contiguous from 0 with one terminal event,
  nothing is generated twice (every completed text equals the greedy text of its prompt, and
  each long task ends as its policy says), and streams through the surviving server of tasks
  the other drove saw exactly the stored log;
- a write lock held on the database for seconds (as another server's transaction may) does
  not stall the server's event loop: it keeps answering while its runner waits.
"""

from __future__ import annotations

import json
import random
import signal
import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from serverproc import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

TERMINAL = {"response.completed", "response.incomplete", "response.failed", "response.cancelled"}
POLICIES = ("fail", "retry", "resume")
# Short leases and frequent heartbeats, so that the tests take seconds, not minutes.
LEASE = {"lease_seconds": 30, "heartbeat_interval": 0.5}
SLOW = {"engine_token_delay": 0.05, "snapshot_interval": 0.02}
# The long tasks of the 200-task test: at least ANCHOR_TOKENS paced steps (>= 6 s), longer than
# the burst of short tasks created while they run.
ANCHOR_TOKENS = 600


def create(client, **body):
    body = {"input": "Tell me a story about a robot.", "background": True, **body}
    r = client.post("/responses", json=body)
    assert r.status_code == 202, r.text
    return r.json()


def create_short(server, prompt, on_restart):
    """A greedy background task of 8 tokens created through `server` on a client of its own
    (so that several threads may create at once)."""
    with server.client() as c:
        return create(c, input=prompt, max_output_tokens=8, temperature=0, on_restart=on_restart)


def events(client, task_id):
    r = client.get(f"/tasks/{task_id}/events", params={"limit": 1000})
    assert r.status_code == 200, r.text
    page = r.json()
    assert not page["has_more"]
    return page["data"]


def deltas(log):
    return [e for e in log if e["type"] == "response.output_text.delta"]


def text_of(log):
    return "".join(e["delta"] for e in deltas(log))


def finished(task, _log=None):
    return task["state"] in ("completed", "failed", "cancelled")


def wait_for(client, task_id, predicate, timeout=90.0):
    deadline = time.monotonic() + timeout
    task = None
    while time.monotonic() < deadline:
        task = client.get(f"/tasks/{task_id}").json()
        log = events(client, task_id)
        if predicate(task, log):
            return task, log
        time.sleep(0.05)
    raise AssertionError(f"{task_id} never satisfied the condition: {task}")


def check_log(log):
    """Contiguous from 0, `response.created` first, exactly one terminal event, last."""
    assert [e["sequence_number"] for e in log] == list(range(len(log)))
    assert log[0]["type"] == "response.created"
    assert sum(e["type"] in TERMINAL for e in log) == 1, [e["type"] for e in log]
    assert log[-1]["type"] in TERMINAL
    return log[-1]


def final_text(log):
    output = log[-1]["response"]["output"]
    return output[0]["content"][0]["text"] if output else ""


def check_greedy_text(log, prompt, expected, task_id):
    """A completed task of 8 greedy tokens generated nothing twice: the text the events of its
    last attempt carry is the final text, which is the greedy text of its prompt (the same for
    every task of that prompt: `expected`, by prompt, is filled as tasks are checked)."""
    types = [e["type"] for e in log]
    final = final_text(log)
    last_attempt = len(log) - 1 - types[::-1].index("response.output_item.added")
    assert text_of(log[last_attempt:]) == final
    expected.setdefault(prompt, final)
    assert final == expected[prompt], (task_id, final, expected[prompt])
    assert log[-1]["response"]["usage"]["output_tokens"] == 8


def check_resumed_as_uninterrupted(
    client, results, seen, max_output_tokens, timeout=90.0, same_usage=False
):
    """The `resume` tasks of a recovery, greedy (`"resume"`) and seeded (`"seeded"`: temperature
    0.9, seed 77), continued where the last commit left off: each log in `results` only grew
    from what was `seen` before the kill, has one output item, and ends with the text an
    uninterrupted run of the same request gives (run now, through `client`); with
    `same_usage`, the same number of output tokens too."""
    for name, temperature, seed in (("resume", 0, None), ("seeded", 0.9, 77)):
        log = results[name]
        assert log[: len(seen[name])] == seen[name]  # the log only grew
        assert [e["type"] for e in log].count("response.output_item.added") == 1
        extra = {"seed": seed} if seed is not None else {}
        ref = create(
            client,
            max_output_tokens=max_output_tokens,
            temperature=temperature,
            on_restart="fail",
            **extra,
        )
        _, ref_log = wait_for(client, ref["task_id"], finished, timeout=timeout)
        assert text_of(log) == final_text(log) == final_text(ref_log), name
        if same_usage:
            assert (
                log[-1]["response"]["usage"]["output_tokens"]
                == (ref_log[-1]["response"]["usage"]["output_tokens"])
            )


def stream(server, task_id, after=-1):
    """Every event of the task's SSE stream after `after`, until the terminal one."""
    out = []
    with (
        server.client(timeout=120) as c,
        c.stream(
            "GET",
            f"/tasks/{task_id}/events",
            params={"stream": "true", "starting_after": after},
        ) as r,
    ):
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.append(json.loads(line[6:]))
                if out[-1]["type"] in TERMINAL:
                    break
    return out


def write_lock_is_held(path) -> bool:
    conn = sqlite3.connect(path, timeout=0, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
    except sqlite3.OperationalError:
        return True
    else:
        conn.execute("ROLLBACK")
        return False
    finally:
        conn.close()


def in_thread(fn, *args):
    result: dict = {}

    def run():
        try:
            result["value"] = fn(*args)
        except BaseException as e:  # reported by the test
            result["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


# ---------------------------------------------------------------------------------------------


@pytest.fixture(params=["sqlite", "postgresql"])
def shared_db(request):
    """The servers' database option: their data folder's SQLite file (none needed), or one
    PostgreSQL database (whose events reach the other server by LISTEN/NOTIFY)."""
    if request.param == "sqlite":
        return {}
    return {"db_url": request.getfixturevalue("pg_url")}


def test_a_second_server_leaves_live_tasks_alone_then_recovers_them_when_the_first_dies(
    lmsp_data, shared_db
):
    a = ServerProcess(lmsp_data, name="a", max_batch_size=4, **SLOW, **LEASE, **shared_db).start()
    try:
        with a.client() as ca:
            normal = {
                p: create(ca, max_output_tokens=40, temperature=0, on_restart=p) for p in POLICIES
            }
            victim = create(ca, max_output_tokens=400, temperature=0, on_restart="resume")
            wait_for(ca, victim["task_id"], lambda t, log: len(deltas(log)) >= 2)

        with (
            ServerProcess(lmsp_data, name="b", **LEASE, **shared_db).start() as b,
            b.client() as cb,
        ):
            # B lists A's tasks and streams one of them as A commits its events.
            listed = {t["id"] for t in cb.get("/tasks", params={"limit": 100}).json()["data"]}
            assert {r["task_id"] for r in [*normal.values(), victim]} <= listed
            watcher, watched = in_thread(stream, b, normal["resume"]["task_id"])

            # A cancel through B reaches A, which stops the generation.
            r = cb.post(f"/tasks/{victim['task_id']}/cancel")
            assert r.status_code == 200 and r.json()["state"] in ("cancelling", "cancelled")
            task, log = wait_for(cb, victim["task_id"], finished, timeout=30)
            assert task["state"] == "cancelled"
            assert check_log(log)["type"] == "response.cancelled"
            assert log[-1]["response"]["usage"]["output_tokens"] < 400

            # A's other tasks finish normally: none failed, none queued again.
            for policy, resp in normal.items():
                task, log = wait_for(cb, resp["task_id"], finished)
                assert task["state"] == "completed", policy
                types = [e["type"] for e in log]
                assert "response.queued" not in types and "response.failed" not in types
                check_log(log)
            watcher.join(60)
            assert "error" not in watched, watched
            assert watched["value"] == events(cb, normal["resume"]["task_id"])

            # Now tasks A will not finish: one running under each policy (and a seeded resume),
            # and one queued under each policy behind them.
            with a.client() as ca:
                running = {
                    p: create(ca, max_output_tokens=150, temperature=0, on_restart=p)
                    for p in POLICIES
                }
                running["seeded"] = create(
                    ca, max_output_tokens=150, temperature=0.9, seed=77, on_restart="resume"
                )
                queued = {
                    p: create(ca, max_output_tokens=12, temperature=0, on_restart=p)
                    for p in POLICIES
                }
                seen = {}
                for name, resp in running.items():
                    _, seen[name] = wait_for(
                        ca, resp["task_id"], lambda t, log: len(deltas(log)) >= 5
                    )
                for resp in queued.values():
                    assert ca.get(f"/tasks/{resp['task_id']}").json()["state"] == "queued"
            a.kill()
            killed_at = time.monotonic()

            # B recovers A's tasks at once: it sees that A's process is gone.
            task, log = wait_for(
                cb, running["fail"]["task_id"], lambda t, log: t["state"] == "failed", timeout=25
            )
            assert time.monotonic() - killed_at < LEASE["lease_seconds"] / 2
            assert log[-1]["response"]["error"]["code"] == "server_restarted"
            check_log(log)
            task, log = wait_for(cb, queued["fail"]["task_id"], finished)
            assert task["state"] == "failed"
            assert [e["type"] for e in log] == ["response.created", "response.failed"]

            results = {}
            for name, resp in {**running, **{f"queued-{p}": r for p, r in queued.items()}}.items():
                if name in ("fail", "queued-fail"):
                    continue
                task, log = wait_for(cb, resp["task_id"], finished)
                assert task["state"] == "completed", (name, task)
                check_log(log)
                results[name] = log
            assert "response.queued" in [e["type"] for e in results["retry"]]

            # `resume` continued where A's last commit left off, with the text an uninterrupted
            # run gives (run now, on B).
            check_resumed_as_uninterrupted(
                cb, results, seen, max_output_tokens=150, same_usage=True
            )
    finally:
        a.kill()


def test_a_server_on_another_machine_is_recovered_once_its_lease_expired(lmsp_data):
    lease = {"lease_seconds": 4, "heartbeat_interval": 0.5}
    # A registers as a runner of another machine: B cannot look at its process, only at its
    # lease.
    a = ServerProcess(
        lmsp_data, name="a", env={"LMSP_RUNNER_HOST": "machine-a"}, **SLOW, **lease
    ).start()
    try:
        with ServerProcess(lmsp_data, name="b", **lease).start() as b, b.client() as cb:
            with a.client() as ca:
                doomed = create(ca, max_output_tokens=150, temperature=0, on_restart="fail")
                resumed = create(ca, max_output_tokens=150, temperature=0, on_restart="resume")
                for resp in (doomed, resumed):
                    wait_for(ca, resp["task_id"], lambda t, log: len(deltas(log)) >= 3)
            killed_at = time.monotonic()
            a.kill()
            task, log = wait_for(
                cb, doomed["task_id"], lambda t, log: t["state"] == "failed", timeout=30
            )
            waited = time.monotonic() - killed_at
            # Not before the lease ran out (its last heartbeat was at most one interval before
            # the kill), and within the lease timeout and a sweep after it.
            assert waited >= lease["lease_seconds"] - lease["heartbeat_interval"] - 0.3, waited
            assert waited <= lease["lease_seconds"] + 8, waited
            assert log[-1]["response"]["error"]["code"] == "server_restarted"
            task, log = wait_for(cb, resumed["task_id"], finished)
            assert task["state"] == "completed"
            check_log(log)
            ref = create(cb, max_output_tokens=150, temperature=0, on_restart="fail")
            _, ref_log = wait_for(cb, ref["task_id"], finished)
            assert text_of(log) == final_text(log) == final_text(ref_log)
    finally:
        a.kill()


def test_two_servers_two_hundred_tasks_one_killed_midway_and_restarted(lmsp_data):
    rng = random.Random(16)
    prompts = ["Tell me a story.", "What is a robot?", "Name three colours.", "Count to five."]
    # A little slower than it could go, so that the kill finds work in flight.
    pace = {"engine_token_delay": 0.01}
    servers = {
        name: ServerProcess(lmsp_data, name=name, **pace, **LEASE).start() for name in ("a", "b")
    }
    victim = rng.choice(["a", "b"])
    survivor = "b" if victim == "a" else "a"
    created: list[tuple[str, dict]] = []  # (server it was created through, response)
    try:

        def make(i: int) -> tuple[str, dict]:
            name = "ab"[i % 2]
            return name, create_short(servers[name], prompts[i % len(prompts)], POLICIES[i % 3])

        # Long tasks the victim drives, one per policy, seen generating before the burst: the
        # kill lands in the middle of their work however fast the short tasks go (on a quick
        # machine the victim can finish all its short tasks before the kill).
        with servers[victim].client() as c:
            anchors = {
                policy: create(c, max_output_tokens=ANCHOR_TOKENS, temperature=0, on_restart=policy)
                for policy in POLICIES
            }
            for resp in anchors.values():
                wait_for(c, resp["task_id"], lambda t, log: len(deltas(log)) >= 3)
        with ThreadPoolExecutor(8) as pool:
            created += pool.map(make, range(100))
        # Streams through the survivor of tasks the victim drives, opened before the kill.
        followed = [r["task_id"] for name, r in created if name == victim][-6:]
        followed += [r["task_id"] for r in anchors.values()]
        watchers = [in_thread(stream, servers[survivor], t) for t in followed]

        with servers[survivor].client() as c:
            for resp in anchors.values():  # still at work when the kill comes
                assert not finished(c.get(f"/tasks/{resp['task_id']}").json()), resp
        servers[victim].kill()
        servers[victim] = ServerProcess(lmsp_data, name=f"{victim}2", **pace, **LEASE).start()
        with ThreadPoolExecutor(8) as pool:
            created += pool.map(make, range(100, 200))
        assert len(created) == 200

        expected: dict[str, str] = {}
        with servers[survivor].client() as c:
            for i, (_, resp) in enumerate(created):
                task, log = wait_for(c, resp["task_id"], finished, timeout=300)
                last = check_log(log)  # ends exactly once, contiguous from 0
                if task["state"] == "failed":
                    # Only a `fail` task of the killed server may fail, and only for that.
                    assert resp["on_restart"] == "fail", task
                    assert last["response"]["error"]["code"] == "server_restarted"
                    continue
                assert task["state"] == "completed", task
                types = [e["type"] for e in log]
                attempts = types.count("response.output_item.added")
                assert 1 <= attempts <= 1 + types.count("response.queued"), types
                # Nothing generated twice (see `check_greedy_text`).
                check_greedy_text(log, prompts[i % len(prompts)], expected, resp["task_id"])
            # The anchors, which the kill surely interrupted (the short tasks it may or may not
            # have found at work): each ended as its policy says.
            for policy, resp in anchors.items():
                task, log = wait_for(c, resp["task_id"], finished, timeout=300)
                last = check_log(log)
                types = [e["type"] for e in log]
                if policy == "fail":
                    assert task["state"] == "failed", task
                    assert last["response"]["error"]["code"] == "server_restarted"
                    continue
                assert task["state"] == "completed", task
                # `retry` was queued again and started over (a second output item); `resume`
                # went on with the item it had, no event marking the recovery (docs/protocol.md).
                retried = policy == "retry"
                assert ("response.queued" in types) == retried, types
                assert types.count("response.output_item.added") == (2 if retried else 1), types
                last_attempt = len(log) - 1 - types[::-1].index("response.output_item.added")
                assert text_of(log[last_attempt:]) == final_text(log)
                # The greedy text reaches the limit (no EOS before it), as an uninterrupted
                # run's would: nothing generated twice or lost.
                assert last["response"]["usage"]["output_tokens"] == ANCHOR_TOKENS
            for (thread, result), task_id in zip(watchers, followed, strict=True):
                thread.join(120)
                assert "error" not in result, result
                assert result["value"] == events(c, task_id)
    finally:
        for server in servers.values():
            server.kill()


def test_a_write_lock_held_elsewhere_does_not_stall_the_event_loop(lmsp_data):
    with ServerProcess(lmsp_data, name="a", **SLOW, **LEASE).start() as a, a.client() as c:
        resp = create(c, max_output_tokens=200, temperature=0, on_restart="resume")
        wait_for(c, resp["task_id"], lambda t, log: len(deltas(log)) >= 3)
        # Another process (as another server's long transaction would) holds the write lock.
        other = sqlite3.connect(lmsp_data / "lmsp.sqlite", isolation_level=None)
        other.execute("BEGIN IMMEDIATE")
        held_from = time.monotonic()
        slowest = 0.0
        try:
            while time.monotonic() - held_from < 3.0:
                t = time.monotonic()
                assert c.get("/service").status_code == 200
                assert c.get(f"/tasks/{resp['task_id']}").status_code == 200
                slowest = max(slowest, time.monotonic() - t)
                time.sleep(0.05)
            progress_while_held = len(deltas(events(c, resp["task_id"])))
        finally:
            other.execute("ROLLBACK")
            other.close()
        # The server answered throughout, while its runner waited for the lock (before, the
        # runner's commits ran on the loop and stalled it until the lock was released).
        assert slowest < 1.0, slowest
        task, log = wait_for(c, resp["task_id"], finished)
        assert task["state"] == "completed"
        check_log(log)
        assert len(deltas(log)) > progress_while_held


def test_a_frozen_server_whose_lease_expired_cannot_write_over_the_adopter(lmsp_data):
    """A server on another machine stops answering (SIGSTOP: frozen, not dead) past its lease:
    the other server adopts its `resume` task and finishes it. When the frozen one wakes up,
    its commits to the task are refused, it learns it lost its lease and stops the generation:
    the log holds one contiguous run with the uninterrupted text."""
    lease = {"lease_seconds": 3, "heartbeat_interval": 0.5}
    a = ServerProcess(
        lmsp_data, name="a", env={"LMSP_RUNNER_HOST": "machine-a"}, **SLOW, **lease
    ).start()
    try:
        with ServerProcess(lmsp_data, name="b", **lease).start() as b, b.client() as cb:
            with a.client() as ca:
                resp = create(ca, max_output_tokens=150, temperature=0, on_restart="resume")
                wait_for(ca, resp["task_id"], lambda t, log: len(deltas(log)) >= 5)
            assert a.proc is not None
            # Frozen between two transactions: a process frozen inside one keeps SQLite's
            # write lock, and then nobody can write (no server could do anything about that).
            for _ in range(50):
                a.proc.send_signal(signal.SIGSTOP)
                if not write_lock_is_held(lmsp_data / "lmsp.sqlite"):
                    break
                a.proc.send_signal(signal.SIGCONT)
                time.sleep(0.01)
            else:
                raise AssertionError("the server always held the write lock")
            try:
                task, log = wait_for(cb, resp["task_id"], finished, timeout=120)
            finally:
                a.proc.send_signal(signal.SIGCONT)
            assert task["state"] == "completed"
            # A wakes up with generated text it never committed, and a lease that is gone.
            deadline = time.monotonic() + 30
            while "lost its lease" not in a.log_path.read_text(errors="replace"):
                assert time.monotonic() < deadline, a.log_tail()
                time.sleep(0.2)
            time.sleep(1.0)
            after = events(cb, resp["task_id"])
            assert after == log  # nothing written over the finished task
            check_log(after)
            assert [e["type"] for e in after].count("response.output_item.added") == 1
            ref = create(cb, max_output_tokens=150, temperature=0, on_restart="fail")
            _, ref_log = wait_for(cb, ref["task_id"], finished)
            assert text_of(after) == final_text(after) == final_text(ref_log)
            with a.client() as ca:  # A goes on serving, under a new lease
                assert ca.get("/service").status_code == 200
            log_a = a.log_path.read_text(errors="replace")
            assert "stopping its generation" in log_a
            assert "Traceback" not in log_a, log_a[-3000:]
    finally:
        if a.proc is not None and a.proc.poll() is None:
            a.proc.send_signal(signal.SIGCONT)
        a.kill()
