"""What a watcher sees of a running task's text: the first tokens are committed (and so sent)
at once, the rest coalesced one transaction per snapshot interval (LMSP B7)."""

from __future__ import annotations

import pytest
from serverproc import ServerProcess
from test_crash_recovery import create, deltas, finished, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_the_first_text_does_not_wait_for_the_snapshot_interval(lmsp_data):
    # An interval far longer than the whole generation (8 tokens, 0.3 s apart): every token
    # after the first is held until the task ends.
    with (
        ServerProcess(lmsp_data, engine_token_delay=0.3, snapshot_interval=60.0) as server,
        server.client() as c,
    ):
        task_id = create(c, max_output_tokens=8, temperature=0)["task_id"]
        task, log = wait_for(c, task_id, lambda task, log: deltas(log) or finished(task, log))
        assert task["state"] == "running", "the first text came only with the end"
        task, log = wait_for(c, task_id, finished)
    assert task["state"] == "completed"
    # The first commit, then everything else at the end.
    assert len(deltas(log)) == 2, deltas(log)
