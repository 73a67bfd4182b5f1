"""Conversations in the store (issue 38), on SQLite and PostgreSQL.

What these tests prove:

- a conversation is created with its first items; items keep the order they were added in,
  are listed a page at a time in either order after a given item, and one is read and
  deleted; new metadata replaces the old; deleting a conversation deletes its items;
- the rule that ends a response (`rules.finish`) adds a completed response's turn — its input
  items, then its output items — to its conversation in the transaction that writes its
  terminal event: when that transaction fails, neither the terminal event nor any item is
  there; a failed (restart with policy `fail`) or cancelled response adds nothing; a
  response resumed after a restart adds its turn once, when it ends.
"""

from __future__ import annotations

import json
import time

import pytest
from storehelpers import (
    INTEGRITY_ERRORS,
    new_task,
    open_db,
    query,
    task_row,
    to_running,
    types_of,
    usage,
)

from jupyter_lmsp.protocol.ids import new_id
from jupyter_lmsp.protocol.states import TaskState
from jupyter_lmsp.store import conversations as store
from jupyter_lmsp.store import rules
from jupyter_lmsp.store.tables import Conversation


@pytest.fixture
def db(db_url):
    database = open_db(db_url)
    yield database
    database.dispose()


def _message(text: str) -> dict:
    return {
        "type": "message",
        "id": new_id("msg"),
        "role": "user",
        "status": "completed",
        "content": [{"type": "input_text", "text": text}],
    }


def _conversation(db, items=()) -> str:
    conversation = Conversation(id=new_id("conv"), owner="owner", created_at=time.time())
    store.create_conversation(db, conversation, list(items))
    return conversation.id


def _texts(rows) -> list[str]:
    return [json.loads(r.item)["content"][0]["text"] for r in rows]


def test_items_keep_their_order_and_page_both_ways(db):
    cid = _conversation(db, [_message("a"), _message("b")])
    store.add_items(db, cid, [_message(t) for t in "cde"])
    page, more = store.list_items(db, cid, limit=2, order="asc")
    assert _texts(page) == ["a", "b"] and more
    page, more = store.list_items(db, cid, after=page[-1].id, limit=10, order="asc")
    assert _texts(page) == ["c", "d", "e"] and not more
    page, more = store.list_items(db, cid, limit=3)  # desc by default
    assert _texts(page) == ["e", "d", "c"] and more
    page, more = store.list_items(db, cid, after=page[-1].id, limit=3)
    assert _texts(page) == ["b", "a"] and not more

    victim = page[0]
    assert store.get_item(db, cid, victim.id).item == victim.item
    assert store.delete_item(db, cid, victim.id)
    assert not store.delete_item(db, cid, victim.id)
    assert store.get_item(db, cid, victim.id) is None
    assert [m["content"][0]["text"] for m in store.conversation_items(db, cid)] == list("acde")
    store.add_items(db, cid, [_message("f")])  # after the last, never in the hole
    assert [m["content"][0]["text"] for m in store.conversation_items(db, cid)] == list("acdef")

    assert json.loads(store.update_metadata(db, cid, {"topic": "x"}).labels) == {"topic": "x"}
    assert json.loads(store.get_conversation(db, cid).labels) == {"topic": "x"}
    assert store.delete_conversation(db, cid)
    assert store.get_conversation(db, cid) is None and store.list_items(db, cid) is None
    assert query(
        db, "SELECT COUNT(*) FROM conversation_items WHERE conversation_id = ?", (cid,)
    ) == [(0,)]
    assert store.add_items(db, cid, [_message("g")]) is None
    assert not store.delete_conversation(db, cid)


def _turn(db, cid: str, on_restart: str = "fail") -> str:
    """A response in conversation `cid` with one earlier message and this input, running."""
    task, response = new_task(on_restart)
    response.conversation_id = cid
    response.request = json.dumps(
        {
            "seed": 7,
            "conversation": [
                {"role": "user", "content": "earlier"},
                {"role": "user", "content": "this input"},
            ],
            "input_count": 1,
        }
    )
    rules.create_task(db, task, response)
    to_running(db, task.id)
    return task.id


def _completed(db, tid: str) -> rules.Committed:
    return rules.finish(db, tid, rules.Outcome(TaskState.COMPLETED, usage=usage()))


def test_a_completed_turn_joins_its_conversation_with_its_terminal_event(db):
    cid = _conversation(db, [_message("first")])
    tid = _turn(db, cid)
    committed = _completed(db, tid)
    items = store.conversation_items(db, cid)
    assert [i["type"] for i in items] == ["message", "message", "message"]
    assert items[1]["role"] == "user" and items[1]["content"][0]["text"] == "this input"
    assert items[2]["role"] == "assistant"
    assert items[2]["content"][0]["text"] == "Hello world"
    assert items[2]["id"] == json.loads(committed.response.output)[0]["id"]
    rows, _ = store.list_items(db, cid, order="asc")
    assert [r.response_id for r in rows] == [None, committed.response.id, committed.response.id]


def test_a_turn_whose_items_cannot_be_written_leaves_no_terminal_event(db):
    cid = _conversation(db)
    tid = _turn(db, cid)
    # The answer's item id already stands in the conversation: the turn's INSERT fails, and
    # with it the whole ending.
    answer_id = "msg_" + task_row(db, tid)["response_id"].split("_", 1)[1]
    store.add_items(db, cid, [{**_message("squatter"), "id": answer_id}])
    with pytest.raises(INTEGRITY_ERRORS):
        _completed(db, tid)
    assert task_row(db, tid)["state"] == "running"
    assert "response.completed" not in types_of(db, tid)
    assert len(store.conversation_items(db, cid)) == 1


def test_failed_and_cancelled_responses_add_nothing_and_a_resumed_one_adds_once(db):
    cid = _conversation(db)
    failed = _turn(db, cid, on_restart="fail")
    resumed = _turn(db, cid, on_restart="resume")
    _completed(db, _turn(db, cid))
    # A cancel accepted while it runs: the generation's end then makes it `cancelled`.
    cancelled = _turn(db, cid)
    rules.request_cancel(db, cancelled)
    rules.finish(db, cancelled, rules.Outcome(TaskState.COMPLETED, usage=usage()))
    assert task_row(db, cancelled)["state"] == "cancelled"
    before = len(store.conversation_items(db, cid))
    assert before == 2  # the one completed turn: its input and its answer

    report = rules.recover_at_startup(db)  # the tasks no runner holds: the 11.3 table
    assert task_row(db, failed)["state"] == "failed" and report.examined >= 2
    assert task_row(db, resumed)["state"] == "running"
    assert len(store.conversation_items(db, cid)) == before
    _completed(db, resumed)
    assert _completed(db, resumed).changed is False
    assert len(store.conversation_items(db, cid)) == before + 2
