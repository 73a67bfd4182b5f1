"""`service_tier` as queue priority (issue 36): within one caller's line `priority` work is
served before `default`, and `flex` after it; a caller whose line holds only flex work lets
every other caller's work go first; no tier lets one caller pass another's turn.

The queue itself, then a real server with one batch row and a slowed engine: a long response
holds the row while the same caller queues a default, a flex and a priority request, and they
run priority, default, flex (their completion order with one row); the tier is echoed, a
restarted runner reads it back from the task's params, and a tier the queue has not is a 400.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from sdkserver import MODEL, sdk_server
from serverproc import ServerProcess

from jupyter_lmsp.services.fairqueue import FairQueue, Tier, tier_of

pytestmark = pytest.mark.timeout(180)


def test_tiers_order_an_owners_own_line():
    q = FairQueue()
    q.push("d1", "alice")
    q.push("f1", "alice", Tier.FLEX)
    q.push("p1", "alice", Tier.PRIORITY)
    q.push("d2", "alice")
    q.push("p2", "alice", Tier.PRIORITY)
    assert [q.pop() for _ in range(5)] == ["p1", "p2", "d1", "d2", "f1"]


def test_priority_never_passes_another_owners_turn():
    q = FairQueue()
    q.push("b1", "bob")
    q.push("a1", "alice", Tier.PRIORITY)
    q.push("a2", "alice", Tier.PRIORITY)
    q.push("b2", "bob")
    # Turns alternate as without tiers: bob was first.
    assert [q.pop() for _ in range(4)] == ["b1", "a1", "b2", "a2"]


def test_flex_only_owners_wait_for_everyone_elses_work():
    q = FairQueue()
    q.push("f1", "alice", Tier.FLEX)
    q.push("f2", "alice", Tier.FLEX)
    q.push("b1", "bob")
    q.push("c1", "carol", Tier.PRIORITY)
    assert [q.pop() for _ in range(2)] == ["b1", "c1"]
    # Only flex work is left: it runs.
    assert [q.pop() for _ in range(2)] == ["f1", "f2"]
    # A restarted task goes first in its tier; a paused one too, its owner after the others.
    q.push("d", "alice")
    q.push_front("r", "alice", Tier.FLEX)
    q.push_paused("p", "bob", Tier.PRIORITY)
    assert [q.pop() for _ in range(3)] == ["d", "p", "r"]


def test_a_task_rows_tier_is_read_from_its_params():
    row = SimpleNamespace
    assert tier_of(row(params=json.dumps({"service_tier": "priority"}))) is Tier.PRIORITY
    assert tier_of(row(params=json.dumps({"service_tier": "flex"}))) is Tier.FLEX
    assert tier_of(row(params=json.dumps({"max_tokens": 4}))) is Tier.DEFAULT
    assert tier_of(row(params="{}")) is Tier.DEFAULT


# -- on a real server ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory, test_model_dir) -> Iterator[ServerProcess]:
    with sdk_server(
        tmp_path_factory.mktemp("tiers"),
        test_model_dir,
        max_batch_size=1,
        # Slow enough that the first response still holds the row (it may end at EOS well
        # before its limit) while the others are created, on a busy machine too.
        engine_token_delay=0.1,
    ) as s:
        yield s


@pytest.fixture
def http(server) -> Iterator[httpx.Client]:
    with server.client() as c:
        yield c


def create(http: httpx.Client, tokens: int, **fields: Any) -> dict[str, Any]:
    r = http.post(
        "/responses",
        json={
            "model": MODEL,
            "input": "Hello",
            "background": True,
            "temperature": 0,
            "max_output_tokens": tokens,
            # The random test model ends only at the limit: every answer is `tokens` long.
            "stop": None,
            **fields,
        },
    )
    assert r.status_code in (200, 202), r.text
    return r.json()


def finished(http: httpx.Client, response_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        body = http.get(f"/responses/{response_id}").json()
        if body["status"] not in ("queued", "in_progress"):
            return body
        time.sleep(0.1)
    raise AssertionError(f"{response_id} did not finish")


@pytest.mark.slow  # the module's server subprocess
def test_one_callers_requests_run_by_tier(http):
    # The row is busy for a while (its tokens at 100 ms or more each).
    busy = create(http, 200)
    deadline = time.monotonic() + 60
    while http.get(f"/responses/{busy['id']}").json()["status"] == "queued":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    default = create(http, 4)
    # All three wait while the row is busy: the order is the queue's.
    flex = create(http, 4, service_tier="flex")
    priority = create(http, 4, service_tier="priority")
    auto = create(http, 4, service_tier="auto")
    assert http.get(f"/responses/{busy['id']}").json()["status"] == "in_progress"
    done = {
        name: finished(http, r["id"])
        for name, r in [
            ("busy", busy),
            ("default", default),
            ("flex", flex),
            ("priority", priority),
            ("auto", auto),
        ]
    }
    assert all(r["status"] in ("completed", "incomplete") for r in done.values()), done
    # With one row they run one after another: their tasks' end times (to the microsecond;
    # a response's `completed_at` is whole seconds) give the order they ran in.
    ended = {
        name: http.get(f"/tasks/{r['task_id']}").json()["finished_at"] for name, r in done.items()
    }
    order = sorted(done, key=lambda name: ended[name])
    assert order == ["busy", "priority", "default", "auto", "flex"], order
    assert done["priority"]["service_tier"] == "priority"
    assert done["flex"]["service_tier"] == "flex"
    assert done["default"]["service_tier"] == "default"
    assert done["auto"]["service_tier"] == "default"


@pytest.mark.slow  # the module's server subprocess
def test_chat_completions_take_the_tier_too(http):
    r = http.post(
        "/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 2,
            "service_tier": "priority",
        },
    )
    assert r.status_code == 200, r.text
    response = http.get(f"/responses/{r.json()['response_id']}").json()
    assert response["service_tier"] == "priority"


@pytest.mark.parametrize("tier", ["scale", "fast", 3])
@pytest.mark.slow  # the module's server subprocess
def test_a_tier_the_queue_has_not_is_a_400(http, tier):
    r = http.post("/responses", json={"model": MODEL, "input": "Hi", "service_tier": tier})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "service_tier"
