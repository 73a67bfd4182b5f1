"""The stored snapshot JSON is the shape protocol.snapshot declares.

Every snapshot the real rule functions store (a running task with text, every recovery policy,
each terminal state) and every snapshot an attempt with choices, calls and a cut-off call dumps
uses only the declared keys and loads back validated to the same dict; a snapshot with a value
of the wrong type is refused as it loads, and one of the first releases' layout still loads.
"""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError
from storehelpers import POLICIES, TERMINAL, make_task, open_db, task_row

from jupyter_lmsp.protocol import snapshot as stored
from jupyter_lmsp.protocol.output import Attempt, Batch, CallArguments, CallBegin, ChoiceEnd, Text
from jupyter_lmsp.store import rules


def check(text: str | None) -> None:
    assert text, "the task has a snapshot"
    raw = json.loads(text)
    assert set(raw) <= stored.KEYS, set(raw) - stored.KEYS
    for item in raw.get("items", []):
        assert set(item) <= stored.ITEM_KEYS, set(item) - stored.ITEM_KEYS
    assert stored.load(text) == raw


@pytest.fixture
def db(tmp_path):
    database = open_db(tmp_path)
    yield database
    database.dispose()


@pytest.mark.parametrize("state", ("running", *TERMINAL))
def test_stored_snapshots_have_the_declared_shape(db, state):
    tid = make_task(db, state)
    row = task_row(db, tid)
    assert row is not None
    check(row["snapshot"])


@pytest.mark.parametrize("policy", POLICIES)
def test_snapshots_after_recovery_have_the_declared_shape(db, policy):
    tid = make_task(db, "running", policy)
    rules.recover_at_startup(db)
    row = task_row(db, tid)
    assert row is not None
    check(row["snapshot"])


@pytest.mark.parametrize("n", [1, 3])
def test_an_attempts_snapshots_have_the_declared_shape(n):
    attempt, _ = Attempt.begin(Attempt.load(None), "abc", 5, n=n, eager=False, label_choices=True)
    check(attempt.dump())
    for choice in range(n):
        attempt.apply(Batch({choice: ([1], "Hi")}, [Text(choice, "Hi")]))
        check(attempt.dump())
        attempt.apply(
            Batch(
                {choice: ([2], "{")},
                [CallBegin(choice, 0, "f"), CallArguments(choice, 0, "{")],
            )
        )
        check(attempt.dump())
        attempt.apply(Batch({}, [ChoiceEnd(choice, "length")]))
    attempt.close("incomplete")
    check(attempt.dump())
    again, _ = Attempt.begin(Attempt.load(attempt.dump()), "abc", 5, n=n)
    check(again.dump())
    assert again.data["output_index"] == attempt.next_index


def test_a_snapshot_of_the_wrong_shape_is_refused_and_the_first_layout_loads():
    with pytest.raises(ValidationError):
        stored.load(json.dumps({"token_ids": ["11"], "text": ""}))
    with pytest.raises(ValidationError):
        stored.load(json.dumps({"items": [{"type": "message", "id": "m"}]}))
    first = {"output_index": 0, "item_id": "msg_ab", "open": True, "token_ids": [1], "text": "x"}
    attempt = Attempt.load(json.dumps(first))
    assert attempt.open and attempt.base == "ab"
    assert [item["id"] for item in attempt.items] == ["msg_ab"]
