"""Speculative decoding across a crash: a real `jupyter server` speculating (the default) is
killed with SIGKILL mid-generation and started again; the `resume` task continues from its last
commit and gives exactly the text a server *without* speculation gives uninterrupted, greedy
and seeded, and its event log stays contiguous with one terminal event."""

from __future__ import annotations

import pytest
from serverproc import ServerProcess
from test_crash_recovery import (
    SLOW,
    check_log,
    create,
    deltas,
    events,
    finished,
    read_sse,
    wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# The test model repeats itself on this prompt: plenty of proposals, some verified.
PROMPT = "Summarise: the server streams events to every client that is watching."


@pytest.mark.parametrize("temperature", [0.0, 0.5])
def test_a_speculating_server_killed_mid_task_resumes_to_the_text_without_speculation(
    lmsp_data, temperature
):
    request = {
        "input": PROMPT,
        "max_output_tokens": 160,
        "temperature": temperature,
        "seed": 99,
        "on_restart": "resume",
    }
    ref_dir = lmsp_data / "ref"
    (ref_dir / "models").mkdir(parents=True)
    (ref_dir / "models" / "tiny").symlink_to((lmsp_data / "models" / "tiny").resolve())
    with (
        ServerProcess(ref_dir, speculative_decoding=False).start() as ref,
        ref.client() as c,
    ):
        reference = create(c, **request)
        _, ref_log = wait_for(c, reference["task_id"], finished)
        expected = check_log(ref_log)
        expected_text = expected["response"]["output"][0]["content"][0]["text"]

    server = ServerProcess(lmsp_data, **SLOW).start()
    with server.client() as c:
        resp = create(c, **request)
        _, seen = wait_for(c, resp["task_id"], lambda t, log: len(deltas(log)) >= 10)
    server.kill()
    seen_until = seen[-1]["sequence_number"]

    with ServerProcess(lmsp_data).start() as server2, server2.client() as c:
        rest = read_sse(server2, f"/tasks/{resp['task_id']}/events", seen_until)
        whole = seen + rest
        last = check_log(whole)
        assert last["type"] == expected["type"]
        assert "".join(e["delta"] for e in deltas(whole)) == expected_text
        final = last["response"]
        assert final["output"][0]["content"][0]["text"] == expected_text
        assert final["usage"]["output_tokens"] == expected["response"]["usage"]["output_tokens"]
        assert events(c, resp["task_id"]) == whole
