"""Standalone inference workers (`jupyter lmsp worker`) on a shared PostgreSQL database.

What these tests prove, with real processes (a Jupyter server without a local worker, worker
processes running MLX) on a real PostgreSQL cluster:

- the shared queue, at the store: `rules.claim_tasks` gives each queued task no runner holds
  to exactly one of several runners claiming at once (FOR UPDATE SKIP LOCKED), only of the
  models asked for, oldest first; a claimed task is that runner's;
- a server with no local worker accepts tasks (202) and streams them: a worker claims them,
  generates, commits every event, and the server's watchers see each event once, in order,
  through LISTEN/NOTIFY; the text equals what a server with its own worker generates;
- a cancel through the server stops the worker's generation within a step;
- a worker killed with SIGKILL mid-generation: its tasks follow the 11.3 table once its lease
  expires (the test runs it as if on another machine, so only the lease tells): `fail` tasks
  fail with `server_restarted`, `retry` ones are queued again, `resume` ones continue on a
  second worker with the very text an uninterrupted run gives.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from serverproc import MODEL, ServerProcess
from storehelpers import make_tasks, open_db, task_row
from test_multi_server import (
    POLICIES,
    check_greedy_text,
    check_log,
    check_resumed_as_uninterrupted,
    create,
    create_short,
    deltas,
    events,
    final_text,
    finished,
    in_thread,
    stream,
    wait_for,
)

from jupyter_lmsp.store import rules

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

LEASE = {"lease_seconds": 6, "heartbeat_interval": 0.5}


class WorkerProcess:
    """`jupyter lmsp worker` on the shared database, as a subprocess."""

    def __init__(
        self,
        data_dir: Path,
        db_url: str,
        name: str,
        *,
        models: str = "",
        host: str | None = None,
        **traits: object,
    ) -> None:
        self.log_path = data_dir / f"worker-{name}.log"
        command = [
            sys.executable,
            "-m",
            "jupyter_lmsp.cli",
            "worker",
            f"--db-url={db_url}",
            f"--data-dir={data_dir}",
            "--log-level=INFO",
        ]
        if models:
            command.append(f"--models={models}")
        for key, value in {**LEASE, **traits}.items():
            command.append(f"--LMSPExtension.{key}={value}")
        env = dict(os.environ)
        if host is not None:
            env["LMSP_RUNNER_HOST"] = host  # as if on another machine: only its lease counts
        self.log = open(self.log_path, "w")  # noqa: SIM115  (closed in stop)
        self.proc = subprocess.Popen(
            command, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=data_dir
        )

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"worker exited: {self.log_path.read_text()}")
            if "serving" in self.log_path.read_text():
                return
            time.sleep(0.1)
        raise AssertionError(f"worker never started: {self.log_path.read_text()}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)
        self.log.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self.log.close()


# ---------------------------------------------------------------------------------------------
# the shared queue, at the store


def test_concurrent_claims_take_each_queued_task_once(pg_url):
    db = open_db(pg_url)
    try:
        ids = make_tasks(db, 60, "queued")
        # Nobody holds them: the shared queue.
        with db.writing() as conn:
            conn.exec_driver_sql("UPDATE tasks SET runner_id = NULL")
            conn.exec_driver_sql(
                "INSERT INTO runners (id, kind, host, boot_id, pid, process_started_at, label,"
                " started_at, heartbeat_at, lease_expires_at) VALUES"
                " ('w1', 'worker', 'h', 'b', 1, 0, '', 0, 0, 1e12),"
                " ('w2', 'worker', 'h', 'b', 2, 0, '', 0, 0, 1e12),"
                " ('w3', 'worker', 'h', 'b', 3, 0, '', 0, 0, 1e12)"
            )
        got: dict[str, list[str]] = {"w1": [], "w2": [], "w3": []}
        barrier = threading.Barrier(3)

        def claimer(runner_id: str) -> None:
            barrier.wait(10)
            while True:
                claimed = rules.claim_tasks(db, runner_id, ["test-model"], limit=4)
                if not claimed:
                    return
                got[runner_id].extend(t for t, _ in claimed)

        threads = [threading.Thread(target=claimer, args=(r,)) for r in got]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        everyone = [t for claimed in got.values() for t in claimed]
        assert sorted(everyone) == sorted(ids)  # each task claimed once, by one runner
        for runner_id, claimed in got.items():
            for task_id in claimed:
                assert task_row(db, task_id)["runner_id"] == runner_id
        # Another model's tasks, and tasks someone holds, are not claimed.
        assert rules.claim_tasks(db, "w1", ["other-model"], limit=10) == []
        assert rules.claim_tasks(db, "w1", None, limit=10) == []
    finally:
        db.dispose()


# ---------------------------------------------------------------------------------------------
# real processes


@pytest.fixture
def deployment(lmsp_data, pg_url):
    """A server without a local worker on a PostgreSQL database; workers are started by the
    test (`start_worker`)."""
    workers: list[WorkerProcess] = []
    server = ServerProcess(lmsp_data, name="s", local_worker=False, db_url=pg_url, **LEASE).start()

    def start_worker(name: str, **kw: object) -> WorkerProcess:
        worker = WorkerProcess(
            lmsp_data,
            pg_url,
            name,
            engine_token_delay=kw.pop("engine_token_delay", 0.02),
            max_batch_size=4,
            **kw,
        )
        workers.append(worker)
        worker.wait_ready()
        return worker

    try:
        yield server, start_worker
    finally:
        for worker in workers:
            worker.stop()
        server.stop()


def test_a_server_without_a_local_worker_accepts_and_streams_what_a_worker_generates(
    deployment, lmsp_data
):
    server, start_worker = deployment
    with server.client() as c:
        # Accepted with no worker running at all: it waits in the shared queue.
        queued = create(c, max_output_tokens=30, temperature=0, on_restart="fail")
        time.sleep(1.0)
        assert c.get(f"/tasks/{queued['task_id']}").json()["state"] == "queued"
        assert c.get("/service").status_code == 200

        start_worker("w1", models=MODEL)
        task, log = wait_for(c, queued["task_id"], finished, timeout=120)
        assert task["state"] == "completed"
        check_log(log)

        # Streamed through the server as the worker commits: every event once, in order.
        second = create(c, max_output_tokens=30, temperature=0, on_restart="fail")
        seen = stream(server, second["task_id"])
        assert seen == events(c, second["task_id"])
        check_log(seen)
        assert final_text(seen) == final_text(log)  # the same prompt, greedy: the same text

        # A cancel through the server stops the worker's generation.
        long = create(c, max_output_tokens=400, temperature=0, on_restart="fail")
        wait_for(c, long["task_id"], lambda t, log: len(deltas(log)) >= 2, timeout=120)
        r = c.post(f"/tasks/{long['task_id']}/cancel")
        assert r.status_code == 200
        task, log = wait_for(c, long["task_id"], finished, timeout=60)
        assert task["state"] == "cancelled"
        check_log(log)
        assert log[-1]["response"]["usage"]["output_tokens"] < 400


def test_a_worker_killed_midway_its_tasks_follow_the_table_and_resume_on_another(
    deployment, lmsp_data
):
    server, start_worker = deployment
    # As if on another machine: the server and the second worker learn of its death only when
    # its lease expires.
    victim = start_worker("w1", host="elsewhere", engine_token_delay=0.05)
    with server.client() as c:
        running = {
            p: create(c, max_output_tokens=120, temperature=0, on_restart=p)
            for p in ("fail", "retry", "resume")
        }
        running["seeded"] = create(
            c, max_output_tokens=120, temperature=0.9, seed=77, on_restart="resume"
        )
        seen = {}
        for name, resp in running.items():
            _, seen[name] = wait_for(
                c, resp["task_id"], lambda t, log: len(deltas(log)) >= 3, timeout=120
            )
        victim.kill()
        killed_at = time.monotonic()
        start_worker("w2")

        task, log = wait_for(
            c, running["fail"]["task_id"], lambda t, log: t["state"] == "failed", timeout=60
        )
        assert time.monotonic() - killed_at >= LEASE["lease_seconds"] - 1  # the lease told
        assert log[-1]["response"]["error"]["code"] == "server_restarted"
        check_log(log)

        results = {}
        for name in ("retry", "resume", "seeded"):
            task, log = wait_for(c, running[name]["task_id"], finished, timeout=120)
            assert task["state"] == "completed", (name, task)
            check_log(log)
            results[name] = log
        assert "response.queued" in [e["type"] for e in results["retry"]]

        # `resume` continued on the second worker with the text of an uninterrupted run.
        check_resumed_as_uninterrupted(c, results, seen, max_output_tokens=120, timeout=120)


def test_three_servers_two_workers_three_hundred_tasks_a_worker_and_a_server_killed(
    lmsp_data, pg_url
):
    """3 servers (no local worker) and 2 workers on one PostgreSQL database: 300 tasks created
    through random servers and watched through others; midway one worker and one server are
    killed with SIGKILL (the worker as if on another machine: its lease must expire). Every
    task ends exactly once with a log contiguous from 0 and one terminal event; only `fail`
    tasks may fail, and only with `server_restarted`; every completed text is the greedy text
    of its prompt (nothing generated twice; `resume` continued with the uninterrupted text);
    every watcher saw every event once and in order."""
    rng = random.Random(17)
    prompts = ["Tell me a story.", "What is a robot?", "Name three colours.", "Count to five."]
    servers = {
        name: ServerProcess(
            lmsp_data, name=name, local_worker=False, db_url=pg_url, **LEASE
        ).start()
        for name in ("a", "b", "c")
    }
    workers: dict[str, WorkerProcess] = {}
    created: list[tuple[str, dict]] = []
    try:
        workers["w1"] = WorkerProcess(
            lmsp_data, pg_url, "w1", host="elsewhere", engine_token_delay=0.01, max_batch_size=8
        )
        workers["w2"] = WorkerProcess(
            lmsp_data, pg_url, "w2", engine_token_delay=0.01, max_batch_size=8
        )
        for worker in workers.values():
            worker.wait_ready()
        alive = ["a", "b", "c"]

        def make(i: int) -> tuple[str, dict]:
            name = rng.choice(alive)
            return name, create_short(servers[name], prompts[i % len(prompts)], POLICIES[i % 3])

        with ThreadPoolExecutor(8) as pool:
            created += pool.map(make, range(150))
        # Watchers through another server than the one each task was created through (and not
        # through the server to be killed), opened before the kills.
        victim_server = "a"
        watched = []
        for name, resp in created[-40:]:
            through = next(s for s in ("b", "c") if s != name)
            watched.append((resp["task_id"], in_thread(stream, servers[through], resp["task_id"])))
        workers["w1"].kill()
        servers[victim_server].kill()
        alive.remove(victim_server)
        with ThreadPoolExecutor(8) as pool:
            created += pool.map(make, range(150, 300))
        assert len(created) == 300

        expected: dict[str, str] = {}
        interrupted = 0
        with servers["b"].client() as c:
            for i, (_, resp) in enumerate(created):
                task, log = wait_for(c, resp["task_id"], finished, timeout=300)
                last = check_log(log)  # ends exactly once, contiguous from 0
                types = [e["type"] for e in log]
                interrupted += task["state"] == "failed" or "response.queued" in types
                if task["state"] == "failed":
                    assert resp["on_restart"] == "fail", task
                    assert last["response"]["error"]["code"] == "server_restarted"
                    continue
                assert task["state"] == "completed", task
                attempts = types.count("response.output_item.added")
                assert 1 <= attempts <= 1 + types.count("response.queued"), types
                if resp["on_restart"] == "resume":
                    assert attempts == 1, types  # resumed in place, never started over
                check_greedy_text(log, prompts[i % len(prompts)], expected, resp["task_id"])
            assert interrupted > 0  # the worker's death did land in the middle of the work
            for task_id, (thread, result) in watched:
                thread.join(120)
                assert "error" not in result, result
                assert result["value"] == events(c, task_id)  # every event, once, in order
    finally:
        for worker in workers.values():
            worker.kill()
        for server in servers.values():
            server.kill()
