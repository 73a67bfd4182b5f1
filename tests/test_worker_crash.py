"""The inference worker process dying must not take Jupyter down: the tasks it held follow
their restart policy (`worker_crashed` for `fail`), a new worker starts, and a `resume` task
finishes with the text an uninterrupted run gives."""

from __future__ import annotations

import os
import signal
import time

import pytest
from serverproc import ServerProcess
from test_crash_recovery import check_log, create, deltas, finished, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def worker_pid(client) -> int:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        worker = client.get("/service").json()["worker"]
        if worker.get("state") == "ready":
            return worker["pid"]
        time.sleep(0.1)
    raise AssertionError(f"worker never ready: {worker}")


def test_worker_killed_mid_generation(lmsp_data):
    request = {"max_output_tokens": 60, "temperature": 0.7, "seed": 99}
    with (
        ServerProcess(lmsp_data, engine_token_delay=0.03, snapshot_interval=0.02) as server,
        server.client() as c,
    ):
        reference = create(c, **request, on_restart="resume")
        _, ref_log = wait_for(c, reference["task_id"], finished)
        expected = check_log(ref_log)["response"]["output"][-1]["content"][0]["text"]

        for policy in ("resume", "fail", "retry"):
            pid = worker_pid(c)
            resp = create(c, **request, on_restart=policy)
            wait_for(c, resp["task_id"], lambda t, log: len(deltas(log)) >= 10)
            os.kill(pid, signal.SIGKILL)
            task, log = wait_for(c, resp["task_id"], finished)
            last = check_log(log)
            if policy == "fail":
                assert task["state"] == "failed"
                assert task["error"]["code"] == "worker_crashed"
                assert last["type"] == "response.failed"
            else:
                assert task["state"] == "completed", task
                assert last["response"]["output"][-1]["content"][0]["text"] == expected
                if policy == "resume":
                    assert "".join(e["delta"] for e in deltas(log)) == expected
            assert worker_pid(c) != pid  # a new worker took over
        # The server itself never went down.
        assert c.get("/service").status_code == 200
