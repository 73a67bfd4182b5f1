"""kill -9 while a conversation's responses run (issue 38): a real `jupyter server` killed with
SIGKILL mid-generation, then started again on the same database. The response resumed after
the restart adds its turn to the conversation once, when it ends (its input, then its whole
answer, the same items as its response); the one the restart failed adds nothing. Never a
turn twice, never half of one."""

from __future__ import annotations

import time

import pytest
from serverproc import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SLOW = {"engine_token_delay": 0.05, "snapshot_interval": 0.02}


def _wait(client, response_id, done, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        response = client.get(f"/responses/{response_id}").json()
        if done(response):
            return response
        time.sleep(0.05)
    raise AssertionError(f"{response_id} never got there: {response}")


def _items(client, conversation_id):
    page = client.get(
        f"/conversations/{conversation_id}/items", params={"order": "asc", "limit": 100}
    ).json()
    assert not page["has_more"]
    return page["data"]


@pytest.fixture(params=["sqlite", "postgresql"])
def backend(request):
    """The server's database: its data folder's SQLite file, or a PostgreSQL database."""
    if request.param == "sqlite":
        return {}
    return {"db_url": request.getfixturevalue("pg_url")}


def test_kill_9_leaves_a_turn_once_or_not_at_all(lmsp_data, backend):
    server = ServerProcess(lmsp_data, **SLOW, **backend).start()
    with server.client() as c:
        conv = c.post(
            "/conversations", json={"items": [{"role": "user", "content": "Hello there."}]}
        ).json()
        started = {}
        for policy in ("resume", "fail"):
            r = c.post(
                "/responses",
                json={
                    "input": f"Tell me a story ({policy}).",
                    "conversation": conv["id"],
                    "background": True,
                    "on_restart": policy,
                    "temperature": 0,
                    "max_output_tokens": 80,
                },
            )
            assert r.status_code == 202, r.text
            started[policy] = r.json()
        for response in started.values():
            _wait(c, response["id"], lambda r: len(r["output"]) > 0 and r["output"][0]["content"])
        assert len(_items(c, conv["id"])) == 1  # no turn joins before its response ends
        for response in started.values():
            assert c.get(f"/responses/{response['id']}").json()["status"] == "in_progress"
    server.kill()

    with ServerProcess(lmsp_data, **backend).start() as server2, server2.client() as c:
        resumed = _wait(c, started["resume"]["id"], lambda r: r["completed_at"] is not None)
        failed = _wait(c, started["fail"]["id"], lambda r: r["status"] == "failed")
        assert resumed["status"] in ("completed", "incomplete")
        assert failed["error"]["code"] == "server_restarted"
        items = _items(c, conv["id"])
        ids = [item["id"] for item in items]
        assert len(ids) == len(set(ids))
        texts = [part["text"] for item in items for part in item["content"]]
        assert texts[:2] == ["Hello there.", "Tell me a story (resume)."]
        # The answer whole, as the response has it, and nothing of the failed turn.
        assert items[2:] == resumed["output"]
        assert not any("(fail)" in text for text in texts)
