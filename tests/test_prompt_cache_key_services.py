"""`prompt_cache_key` as a routing hint (issue 36): the services' part, on both backends
(the store's is tests/test_prompt_cache_key.py).

What these tests prove:

- a runner remembers the keys of the tasks it claimed and its next claims from the shared
  queue prefer them (`TaskRunner.claim_shared`, a standalone worker's claim): two runners,
  each claiming the tasks of its own keys before older ones of the other's;
- each API gives its request's key to the task: `POST /responses` (through a real server
  without a local worker: the row holds the key, and a claim preferring it returns it), a
  chat completion's spec (a key longer than the column's 64 characters cut to 64), and none
  when none is given.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from jpserver import call, server_config
from storehelpers import open_db, task_row
from test_prompt_cache_key import queue_task, worker

from jupyter_lmsp.protocol.chat import CreateChatCompletionRequest
from jupyter_lmsp.protocol.responses import CreateResponseRequest
from jupyter_lmsp.services import chat, response_spec
from jupyter_lmsp.services.bus import EventBus
from jupyter_lmsp.services.cache_keys import RecentKeys
from jupyter_lmsp.services.runner import TaskRunner
from jupyter_lmsp.store import rules

pytest_plugins = ["pytest_jupyter.jupyter_server"]


@pytest.fixture
def db(db_url):
    database = open_db(db_url)
    yield database
    database.dispose()


def test_a_runner_prefers_the_keys_it_claimed(db):
    """Two standalone runners on one shared queue (`TaskRunner.claim_shared`, what a worker's
    loop calls): each claims the tasks of the keys it claimed before first."""
    t0 = time.time() - 100
    first_a, first_b = queue_task(db, "A", t0), queue_task(db, "B", t0 + 1)

    async def run() -> dict[str, list[str]]:
        loop = asyncio.get_running_loop()
        submitted: dict[str, list[str]] = {}
        made: list[TaskRunner] = []
        for name in ("one", "two"):
            runner = TaskRunner(db, EventBus(), None, None, max_active=1, runner_id=worker(db))
            runner.committer.start(loop)
            got = submitted.setdefault(name, [])

            def submit(task_id: str, owner: str, *_: Any, got: list[str] = got, **__: Any) -> None:
                got.append(task_id)

            runner.submit = submit
            made.append(runner)
        one, two = made
        try:
            # Room for two each (one slot, one batch waiting): "one" takes A's and B's first
            # tasks and remembers both keys; then only A's stay its own.
            assert await one.claim_shared(["test-model"]) == 2
            assert one.recent_keys.keys() == ["A", "B"]
            one.recent_keys = RecentKeys()
            one.recent_keys.add(["A"])
            two.recent_keys.add(["B"])
            later = [queue_task(db, key, t0 + 2 + i) for i, key in enumerate("BBAAB")]
            assert await one.claim_shared(["test-model"]) == 2  # A's, before older B's
            assert await two.claim_shared(["test-model"]) == 2  # the B's
            assert await one.claim_shared(["test-model"]) == 1  # what is left
            submitted["later"] = later
        finally:
            for runner in made:
                runner.committer.stop()
        return submitted

    got = asyncio.run(run())
    b1, b2, a1, a2, b3 = got["later"]
    assert got["one"] == [first_a, first_b, a1, a2, b3]
    assert got["two"] == [b1, b2]


# ---------------------------------------------------------------------------------------------
# the APIs


def test_each_api_gives_the_key_to_the_task():
    body = {"model": "m", "input": "hi", "prompt_cache_key": "conv-1"}
    assert response_spec.spec_of(CreateResponseRequest.model_validate(body)).cache_key == "conv-1"
    spec = response_spec.spec_of(CreateResponseRequest.model_validate({"input": "hi"}))
    assert spec.cache_key is None
    messages = [{"role": "user", "content": "hi"}]
    for given, kept in (("conv-2", "conv-2"), ("x" * 100, "x" * 64), ("", None), (None, None)):
        request = CreateChatCompletionRequest.model_validate(
            {"model": "m", "messages": messages, "prompt_cache_key": given}
        )
        assert chat.spec_of(request, 4).cache_key == kept


@pytest.fixture
def jp_server_config(lmsp_data, request):
    # No local worker: the tasks it accepts go to the shared queue, held by no runner.
    return server_config(lmsp_data, request, local_worker=False)


async def test_post_responses_writes_the_key_a_claim_sees(jp_fetch, lmsp_data):
    status, created, _ = await call(
        jp_fetch,
        "POST",
        "responses",
        {"input": "Hello", "background": True, "max_output_tokens": 4, "prompt_cache_key": "k-1"},
    )
    assert status == 202 and created["prompt_cache_key"] == "k-1"
    _, plain, _ = await call(jp_fetch, "POST", "responses", {"input": "Hi", "background": True})
    db = open_db(lmsp_data)
    try:
        row = task_row(db, created["task_id"])
        assert row["cache_key"] == "k-1" and row["runner_id"] is None
        assert task_row(db, plain["task_id"])["cache_key"] is None
        # A worker that served k-1 takes it first; the claim returns its key.
        claimed = rules.claim_tasks(db, worker(db), None, limit=1, prefer=["k-1"])
        assert [(c.task_id, c.cache_key) for c in claimed] == [(created["task_id"], "k-1")]
    finally:
        db.dispose()
