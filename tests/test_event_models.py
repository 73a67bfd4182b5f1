"""Every event the service appends is one of the `Event` union's models (protocol.events).

The builders return plain dicts (the hot path builds no models); here every kind of log the
store's real rule functions write on a real SQLite file (responses and model registrations,
every state, a cancel, a `retry` recovery, text with log-probabilities, function calls, a job of
several choices) is read back and validated against the union: extra fields are refused, so a
builder that adds, drops or renames a field fails here, and re-dumping the model gives exactly
the stored JSON (the wire payload is the builders', unchanged by the models).
"""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from storehelpers import POLICIES, TERMINAL, UNFINISHED, events_of, make_task, open_db

from jupyter_lmsp.protocol import events as ev
from jupyter_lmsp.protocol.events import Event, event_types
from jupyter_lmsp.protocol.output import Attempt, Batch, CallArguments, CallBegin, CallEnd, Text
from jupyter_lmsp.protocol.states import EVENT_STATES
from jupyter_lmsp.store import rules

REF = "#/components/schemas/"

LOGPROB = {
    "token": "Hi",
    "bytes": [72, 105],
    "logprob": -0.5,
    "top_logprobs": [{"token": "Hi", "bytes": [72, 105], "logprob": -0.5}],
}


def check(event: dict) -> None:
    """`event` validates as the model of its type and dumps back to itself."""
    model = Event.model_validate(event).root
    assert type(model) is event_types()[event["type"]]
    assert model.model_dump(mode="json", exclude_unset=True) == event


@pytest.fixture
def db(tmp_path):
    database = open_db(tmp_path)
    yield database
    database.dispose()


@pytest.mark.parametrize("with_response", [True, False], ids=["response", "registration"])
@pytest.mark.parametrize("state", UNFINISHED + TERMINAL)
def test_every_stored_event_is_one_of_the_union(db, state, with_response):
    tid = make_task(db, state, with_response=with_response)
    log = events_of(db, tid)
    assert log
    for row in log:
        check(row["data"])


@pytest.mark.parametrize("policy", POLICIES)
def test_events_of_a_recovery_are_in_the_union(db, policy):
    tids = [make_task(db, "running", policy), make_task(db, "loading", policy)]
    rules.recover_at_startup(db)
    seen = set()
    for tid in tids:
        for row in events_of(db, tid):
            check(row["data"])
            seen.add(row["type"])
    assert ("response.queued" in seen) == (policy != "fail")
    assert ("response.failed" in seen) == (policy == "fail")


def test_a_registrations_progress_event_is_in_the_union(db):
    tid = make_task(db, "running", with_response=False)
    # As services.registration writes it, from the registering process's progress lines.
    committed = rules.append_events(
        db,
        tid,
        lambda task, _response: [
            {"type": "task.progress", "task_id": task.id, "stage": "hashing", "fraction": 0.5}
        ],
    )
    assert [e["type"] for e in committed.events] == ["task.progress"]
    for row in events_of(db, tid):
        check(row["data"])


@pytest.mark.parametrize("n", [1, 2])
def test_item_events_of_text_calls_and_choices_are_in_the_union(n):
    """The output state machine's events (protocol.output): messages with log-probabilities,
    a function call that completes and one cut off, and `choice` labels when n > 1."""
    attempt, events = Attempt.begin(Attempt.load(None), "abc", 3, n=n, eager=False)
    lookup = {}
    for choice in range(n):
        batch = Batch({choice: ([1, 2], "Hi")}, [Text(choice, "Hi", [LOGPROB])])
        events += attempt.apply(batch)
        batch = Batch(
            {choice: ([3], "{}")},
            [
                CallBegin(choice, 0, "lookup"),
                CallArguments(choice, 0, '{"q": 1}'),
                CallEnd(choice, 0, '{"q": 1}'),
                CallBegin(choice, 1, "other"),
                CallArguments(choice, 1, '{"q"'),
            ],
        )
        events += attempt.apply(batch)
    for item in attempt.items:
        lookup[item["id"]] = [LOGPROB]
    events += attempt.close("incomplete", lambda item_id: lookup[item_id])
    types = {e["type"] for e in events}
    assert types >= {
        ev.ITEM_ADDED,
        ev.PART_ADDED,
        ev.TEXT_DELTA,
        ev.TEXT_DONE,
        ev.PART_DONE,
        ev.ITEM_DONE,
        ev.ARGUMENTS_DELTA,
        ev.ARGUMENTS_DONE,
    }
    assert all(("choice" in e) == (n > 1) for e in events)
    for number, event in enumerate(events):
        check({**event, "sequence_number": number})


def test_the_union_refuses_what_no_builder_makes():
    delta = ev.text_delta("msg_1", 0, "Hi") | {"sequence_number": 4}
    check(delta)
    with pytest.raises(ValidationError):
        Event.model_validate(delta | {"surprise": 1})
    with pytest.raises(ValidationError):
        Event.model_validate({k: v for k, v in delta.items() if k != "delta"})
    with pytest.raises(ValidationError):
        Event.model_validate(delta | {"type": "response.output_text.more"})


def test_every_event_that_moves_a_state_is_a_model_and_the_constants_name_models():
    assert set(EVENT_STATES) <= set(event_types())
    constants = {v for k, v in vars(ev).items() if k.isupper() and isinstance(v, str)}
    assert constants <= set(event_types())


def test_the_document_describes_the_union_with_its_discriminator():
    from jupyter_lmsp import __version__
    from jupyter_lmsp.handlers.openapi import document

    schemas = document("/lmsp/v1", __version__)["components"]["schemas"]
    union = schemas["Event"]
    assert union["discriminator"]["propertyName"] == "type"
    mapping = union["discriminator"]["mapping"]
    assert set(mapping) == set(event_types())
    assert sorted(m["$ref"] for m in union["oneOf"]) == sorted(mapping.values())
    for type_, ref in mapping.items():
        member = schemas[ref.rsplit("/", 1)[1]]
        assert member["properties"]["type"]["const"] == type_
        assert member["additionalProperties"] is False
        assert {"type", "sequence_number"} <= set(member["required"])
    # A task's event page and its SSE stream hold this union.
    assert schemas["EventPage"]["properties"]["data"]["items"] == {"$ref": REF + "Event"}
    assert schemas["EventStreamItem"]["properties"]["data"]["contentSchema"] == {
        "$ref": REF + "Event"
    }


def test_log_probability_entries_are_built_in_the_wire_shape():
    """A message's and a text part's log-probabilities are set in as `logprob_entry` built
    them, not validated again (issue 42): every entry it builds, a token the distribution gave
    no weight (-inf) or NaN included, is a `Logprob` whose dump is the entry itself, and the
    message and part holding them are their models' dumps."""
    from jupyter_lmsp.protocol.response_object import (
        OutputMessage,
        OutputText,
        output_message,
        output_text_part,
    )
    from jupyter_lmsp.protocol.tools import Logprob, logprob_entry

    entries = [
        logprob_entry("Hi", [72, 105], -0.25, [("Hi", [72, 105], -0.25), ("Ho", [72, 111], -2.0)]),
        logprob_entry("\ufffd", [0xE2], float("-inf"), [("x", [120], float("nan"))]),
        logprob_entry(" ", [32], -1e-9, []),
    ]
    for entry in entries:
        assert Logprob.model_validate(entry).wire() == entry
    message = output_message("msg_1", "Hi", "completed", entries)
    assert OutputMessage.model_validate(message).wire() == message
    assert message["content"][0]["logprobs"] == entries
    part = output_text_part("Hi", entries)
    assert OutputText.model_validate(part).wire() == part
    assert output_message("msg_2", "", "incomplete")["content"][0]["logprobs"] == []
