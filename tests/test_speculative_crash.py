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
# Speculating by the cost prior alone: whether a step speculates must not depend on how fast
# this machine runs the test model (learning from measured steps, a machine where the tiny
# model's forward pass costs little next to a lost overlap never speculates).
SPECULATING = {"speculative_learn_costs": False}


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

    server = ServerProcess(lmsp_data, **SLOW, **SPECULATING).start()
    with server.client() as c:
        resp = create(c, **request)
        _, seen = wait_for(c, resp["task_id"], lambda t, log: len(deltas(log)) >= 10)
    server.kill()
    seen_until = seen[-1]["sequence_number"]

    with ServerProcess(lmsp_data, **SPECULATING).start() as server2, server2.client() as c:
        rest = read_sse(server2, f"/tasks/{resp['task_id']}/events", seen_until)
        whole = seen + rest
        last = check_log(whole)
        assert last["type"] == expected["type"]
        assert "".join(e["delta"] for e in deltas(whole)) == expected_text
        final = last["response"]
        assert final["output"][0]["content"][0]["text"] == expected_text
        assert final["usage"]["output_tokens"] == expected["response"]["usage"]["output_tokens"]
        assert events(c, resp["task_id"]) == whole


def test_usage_and_metrics_count_the_accepted_draft_tokens(lmsp_data):
    """`usage.output_tokens_details.accepted_draft_tokens` (Responses) and
    `completion_tokens_details.accepted_draft_tokens` (Chat) say how many output tokens came
    from verified drafts, and `lmsp_accepted_draft_tokens_total` sums them; with speculation
    off they are 0 and the texts are the same."""
    from test_metrics import lmsp_metrics, value

    request = {"input": PROMPT, "max_output_tokens": 120, "temperature": 0, "background": False}
    chat = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 120, "temperature": 0}
    texts = {}
    for speculating in (True, False):
        folder = lmsp_data / f"speculating-{speculating}"
        (folder / "models").mkdir(parents=True)
        (folder / "models" / "tiny").symlink_to((lmsp_data / "models" / "tiny").resolve())
        with (
            ServerProcess(
                folder, speculative_decoding=speculating, **SPECULATING
            ).start() as server,
            server.client() as c,
        ):
            r = c.post("/responses", json=request)
            assert r.status_code == 200, r.text
            response = r.json()
            usage = response["usage"]
            drafted = usage["output_tokens_details"]["accepted_draft_tokens"]
            r = c.post("/chat/completions", json=chat)
            assert r.status_code == 200, r.text
            completion = r.json()
            chat_drafted = completion["usage"]["completion_tokens_details"]["accepted_draft_tokens"]
            texts[speculating] = response["output"][0]["content"][0]["text"]
            if speculating:
                # The test model repeats itself on this prompt: drafts are proposed and verified.
                assert 0 < drafted <= usage["output_tokens"]
                assert 0 < chat_drafted <= completion["usage"]["completion_tokens"]
            else:
                assert drafted == chat_drafted == 0
            total = value(lmsp_metrics(server), "lmsp_accepted_draft_tokens_total", model="tiny")
            assert total == drafted + chat_drafted
    assert texts[True] == texts[False]
