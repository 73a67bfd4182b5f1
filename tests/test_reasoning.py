"""Reasoning kept apart from the answer (issue 37): a thinking model's thinking block becomes a
`reasoning` item (Responses) and `reasoning_content` (Chat Completions), counted as
`reasoning_tokens`, streamed in order, stored, sealed for stateless clients, and resumed after
kill -9 exactly.

The models are "chain" models made here (tests/chainmodel.py): their greedy output is a given
sequence of texts, `<think>` and `</think>` among them, through the real mlx-lm path and the
engine. One writes its own block; another's template opens the block in the generation prompt
(as Qwen3's and R1 distills' do), so its output starts inside it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from chainmodel import THINKING_TEMPLATE, make_chain_model
from openai.types.responses import ResponseReasoningItem, ResponseStreamEvent
from pydantic import TypeAdapter
from serverproc import ServerProcess
from test_crash_recovery import check_log, create, events, finished, read_sse, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

THOUGHTS = ["Two and two", " make four", ", surely."]
ANSWER = "The answer is 4."
WRITER = ["<think>", *THOUGHTS, "</think>", "\n\n", ANSWER]
OPENED = [*THOUGHTS, "</think>", "\n\n", ANSWER]
EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
ASK = [{"role": "user", "content": "What is 2 + 2?"}]


def data_dir(root: Path) -> Path:
    models = root / "models"
    make_chain_model(models / "writer", WRITER)
    make_chain_model(models / "opener", OPENED, template=THINKING_TEMPLATE)
    # A long block, for a kill in the middle of it.
    make_chain_model(
        models / "ponderer",
        ["<think>", *(f" step {i}." for i in range(24)), "</think>", ANSWER],
    )
    return root


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[ServerProcess]:
    with ServerProcess(data_dir(tmp_path_factory.mktemp("reasoning")), default_model="writer") as s:
        yield s


@pytest.fixture
def http(server) -> Iterator[httpx.Client]:
    with server.client() as c:
        yield c


def streamed(http: httpx.Client, body: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    with http.stream("POST", "/responses", json={"input": ASK, "stream": True, **body}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data:"):
                out.append(json.loads(line[5:]))
    for event in out:
        EVENTS.validate_python(event)  # the openai SDK's own event types
    return out


@pytest.mark.parametrize("model", ["writer", "opener"])
def test_thinking_is_a_reasoning_item_before_the_answer(http, model):
    r = http.post("/responses", json={"model": model, "input": ASK, "temperature": 0})
    assert r.status_code == 200, r.text
    response = r.json()
    assert response["status"] == "completed"
    reasoning, message = response["output"]
    ResponseReasoningItem.model_validate(reasoning)
    assert reasoning["type"] == "reasoning" and reasoning["id"].startswith("rs_")
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "".join(THOUGHTS)}]
    assert reasoning["summary"] == [] and "encrypted_content" not in reasoning
    # The answer holds no thinking and no markers (the blank line after the block is not its).
    assert message["content"][0]["text"] == ANSWER
    details = response["usage"]["output_tokens_details"]
    # The block's tokens, markers included: the opener's start marker is the prompt's.
    assert details["reasoning_tokens"] == len(THOUGHTS) + (2 if model == "writer" else 1)
    # Then the blank line and the answer (the end-of-sequence token is not counted).
    assert response["usage"]["output_tokens"] == details["reasoning_tokens"] + 2
    assert http.get(f"/responses/{response['id']}").json()["output"] == response["output"]


def test_the_stream_says_reasoning_then_answer_in_order(http):
    events = streamed(http, {"temperature": 0})
    final = events[-1]["response"]
    reasoning_id, message_id = (item["id"] for item in final["output"])
    kinds = [
        e["type"]
        for e in events
        if e.get("item_id") == reasoning_id or (e.get("item") or {}).get("id") == reasoning_id
    ]
    assert kinds[:2] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-3:] == [
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert set(kinds[2:-3]) == {"response.reasoning_text.delta"}
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert deltas == "".join(THOUGHTS)
    # The reasoning item is done before the message is added.
    done_at = next(
        i
        for i, e in enumerate(events)
        if e["type"] == "response.output_item.done" and e["item"]["id"] == reasoning_id
    )
    added_at = next(
        i
        for i, e in enumerate(events)
        if e["type"] == "response.output_item.added" and e["item"]["id"] == message_id
    )
    assert done_at < added_at
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == ANSWER


def test_chat_completions_give_reasoning_content(http):
    r = http.post("/chat/completions", json={"model": "opener", "messages": ASK})
    assert r.status_code == 200, r.text
    completion = r.json()
    message = completion["choices"][0]["message"]
    assert message["reasoning_content"] == "".join(THOUGHTS)
    assert message["content"] == ANSWER
    assert completion["usage"]["completion_tokens_details"]["reasoning_tokens"] == 4
    with http.stream(
        "POST", "/chat/completions", json={"model": "opener", "messages": ASK, "stream": True}
    ) as s:
        chunks = [
            json.loads(line[5:])
            for line in s.iter_lines()
            if line.startswith("data:") and line[5:].strip() != "[DONE]"
        ]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "".join(THOUGHTS)
    assert "".join(d.get("content") or "" for d in deltas) == ANSWER
    first_answer = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert all("reasoning_content" not in d for d in deltas[first_answer:])


def test_sealed_thinking_goes_back_into_the_next_prompt(http):
    first = http.post(
        "/responses",
        json={
            "model": "opener",
            "input": ASK,
            "store": False,
            "include": ["reasoning.encrypted_content"],
        },
    ).json()
    reasoning, message = first["output"]
    assert reasoning["encrypted_content"].startswith("lmsp1.")

    def prompt_tokens(item: dict[str, Any] | None) -> int:
        turn = [*ASK, *([item] if item else []), message, {"role": "user", "content": "3+3?"}]
        r = http.post("/responses/input_tokens", json={"model": "opener", "input": turn})
        assert r.status_code == 200, r.text
        return int(r.json()["input_tokens"])

    # The sealed blob alone (as a stateless client keeps it) gives the next turn's prompt the
    # same thinking as the plain text does (the opener's template shows earlier thinking).
    sealed_only = {**reasoning, "content": []}
    plain = {k: v for k, v in reasoning.items() if k != "encrypted_content"}
    assert prompt_tokens(sealed_only) == prompt_tokens(plain) > prompt_tokens(None)
    r = http.post(
        "/responses",
        json={"model": "opener", "input": [*ASK, sealed_only, message], "max_output_tokens": 4},
    )
    assert r.status_code == 200, r.text
    # A tampered or foreign blob is a 400 naming the item, never a 500.
    blob = reasoning["encrypted_content"]
    flipped = "A" if blob[-6] != "A" else "B"
    tampered = {**reasoning, "encrypted_content": blob[:-6] + flipped + blob[-5:]}
    r = http.post("/responses", json={"model": "opener", "input": [*ASK, tampered, message]})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "invalid_encrypted_content"
    assert error["param"] == "input[1].encrypted_content"


def test_log_probabilities_of_a_thinking_model_are_refused_clearly(http):
    r = http.post(
        "/responses",
        json={"input": ASK, "include": ["message.output_text.logprobs"], "top_logprobs": 2},
    )
    response = r.json()
    assert response["status"] == "failed"
    assert response["error"]["code"] == "invalid_request"
    assert "thinks" in response["error"]["message"]


def test_a_resume_mid_thinking_ends_as_the_uninterrupted_run(tmp_path):
    request = {"model": "ponderer", "input": ASK, "temperature": 0, "on_restart": "resume"}
    reference = ServerProcess(data_dir(tmp_path / "ref"), default_model="ponderer")
    with reference as ref, ref.client() as c:
        task_id = create(c, **request)["task_id"]
        _, log = wait_for(c, task_id, finished)
        expected = check_log(log)["response"]
    root = data_dir(tmp_path / "killed")
    server = ServerProcess(root, default_model="ponderer", engine_token_delay=0.15).start()
    with server.client() as c:
        task_id = create(c, **request)["task_id"]

        def thinking(_task: Any, log: list[dict[str, Any]]) -> bool:
            return sum(e["type"] == "response.reasoning_text.delta" for e in log) >= 4

        _, seen = wait_for(c, task_id, thinking)
    server.kill()
    assert not any(e["type"] == "response.output_text.delta" for e in seen), "killed too late"
    with ServerProcess(root, default_model="ponderer").start() as again, again.client() as c:
        rest = read_sse(again, f"/tasks/{task_id}/events", seen[-1]["sequence_number"])
        whole = seen + rest
        final = check_log(whole)["response"]
        strip = lambda items: [{k: v for k, v in i.items() if k != "id"} for i in items]  # noqa: E731
        assert strip(final["output"]) == strip(expected["output"])
        assert final["usage"]["output_tokens_details"] == expected["usage"]["output_tokens_details"]
        streamed = "".join(
            e["delta"] for e in whole if e["type"] == "response.reasoning_text.delta"
        )
        assert streamed == final["output"][0]["content"][0]["text"]
        assert events(c, task_id) == whole
