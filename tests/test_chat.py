"""Chat Completions (`POST /lmsp/v1/chat/completions`) inside a real Jupyter Server (jp_fetch):
the `chat.completion` shape, the chunk stream ending in `[DONE]`, the task behind each
completion, cancellation (by the task API and by a client that goes away), idempotent replays,
and 400/404 errors in the LMSP shape."""

from __future__ import annotations

import asyncio
import json

import pytest
from jpserver import MODEL, ServerPool, call, server_config, token_delay, wait_state
from tornado.httpclient import HTTPClientError

pytest_plugins = ["pytest_jupyter.jupyter_server"]
pytestmark = pytest.mark.timeout(120)

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say something."},
]
# Greedy decoding of the test model on this prompt runs long without an end-of-sequence token,
# so a generation of LONG tokens is still going when the tests cancel it.
LONG_PROMPT = [{"role": "user", "content": "Tell me a long story about the sea."}]
LONG = 4000


@pytest.fixture(scope="module")
def server_pool(tmp_path_factory, test_model_dir):
    """One server for the module's tests (another for those with a `token_delay`): they need
    no fresh database, only to know which tasks they made themselves (`newest_task`)."""
    with ServerPool(tmp_path_factory, test_model_dir) as pool:
        yield pool


@pytest.fixture
def jp_fetch(server_pool, request):
    server = server_pool.get(token_delay(request), lambda data: server_config(data, request))
    client = server.client()
    yield client.fetch
    client.close()


async def newest_task(jp_fetch):
    """The id of the newest task on the server, None if there is none."""
    _, page, _ = await call(jp_fetch, "GET", "tasks", params={"limit": 1})
    return page["data"][0]["id"] if page["data"] else None


async def tasks_since(jp_fetch, newest):
    """The ids of the tasks made after the one `newest_task` answered, newest first."""
    _, page, _ = await call(jp_fetch, "GET", "tasks", params={"limit": 100})
    ids = [t["id"] for t in page["data"]]
    return ids[: ids.index(newest)] if newest in ids else ids


async def chat(jp_fetch, body, **kw):
    return await call(jp_fetch, "POST", "chat/completions", body, **kw)


def data_lines(text: str) -> list[str]:
    """The `data:` payloads of a chat stream; the stream has nothing but `data:` lines and
    comments."""
    payloads = []
    for block in text.split("\n\n"):
        for line in block.splitlines():
            if not line or line.startswith(":"):
                continue
            assert line.startswith("data: "), f"not a data line: {line!r}"
            payloads.append(line[len("data: ") :])
    return payloads


def assert_error(status, body, expected_status, code=None, param=None):
    assert status == expected_status, body
    assert set(body) == {"error"}
    assert set(body["error"]) == {"type", "code", "message", "param"}
    assert body["error"]["message"]
    if code is not None:
        assert body["error"]["code"] == code, body
    if param is not None:
        assert body["error"]["param"] == param, body


async def test_plain_completion_shape_and_its_task(jp_fetch):
    status, c, headers = await chat(
        jp_fetch, {"model": MODEL, "messages": MESSAGES, "max_tokens": 8, "temperature": 0}
    )
    assert status == 200 and headers["Content-Type"] == "application/json"
    assert c["object"] == "chat.completion"
    assert c["id"].startswith("chatcmpl-") and c["model"] == MODEL
    assert isinstance(c["created"], int)
    [choice] = c["choices"]
    assert choice["index"] == 0
    assert choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str)
    usage = c["usage"]
    assert usage["prompt_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert 0 < usage["completion_tokens"] <= 8
    if choice["finish_reason"] == "length":
        assert usage["completion_tokens"] == 8
    else:
        assert choice["finish_reason"] == "stop"

    # The work behind it is an ordinary response and task (non-background, policy `fail`).
    assert c["id"] == "chatcmpl-" + c["response_id"].split("_", 1)[1]
    _, task, _ = await call(jp_fetch, "GET", f"tasks/{c['task_id']}")
    assert task["kind"] == "response" and task["state"] == "completed"
    assert task["on_restart"] == "fail"
    _, resp, _ = await call(jp_fetch, "GET", f"responses/{c['response_id']}")
    assert resp["background"] is False
    assert resp["output"][0]["content"][0]["text"] == choice["message"]["content"]
    assert resp["usage"]["output_tokens"] == usage["completion_tokens"]
    assert resp["max_output_tokens"] == 8 and resp["temperature"] == 0


async def test_stream_chunks_then_done(jp_fetch):
    body = {"messages": MESSAGES, "max_completion_tokens": 12, "temperature": 0}
    _, plain, _ = await chat(jp_fetch, body)
    status, text, headers = await chat(
        jp_fetch, {**body, "stream": True, "stream_options": {"include_usage": True}}, raw=True
    )
    assert status == 200
    assert headers["Content-Type"].startswith("text/event-stream")
    payloads = data_lines(text)
    assert payloads[-1] == "[DONE]" and payloads.count("[DONE]") == 1
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert all(ch["object"] == "chat.completion.chunk" for ch in chunks)
    assert len({ch["id"] for ch in chunks}) == 1 and len({ch["created"] for ch in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    # include_usage: every chunk has `usage`, null but in the last, whose `choices` is empty.
    *with_choices, usage_chunk = chunks
    assert usage_chunk["choices"] == []
    # The same prompt again: the prompt cache may serve all of it but the last token.
    streamed_usage, plain_usage = usage_chunk["usage"], plain["usage"]
    cached = streamed_usage["prompt_tokens_details"].pop("cached_tokens")
    plain_usage["prompt_tokens_details"].pop("cached_tokens")
    assert 0 <= cached < streamed_usage["prompt_tokens"]
    assert streamed_usage == plain_usage
    assert all(ch["usage"] is None for ch in with_choices)
    finishes = [ch["choices"][0]["finish_reason"] for ch in with_choices]
    assert finishes[-1] == plain["choices"][0]["finish_reason"]
    assert all(f is None for f in finishes[:-1])
    assert with_choices[-1]["choices"][0]["delta"] == {}
    streamed = "".join(ch["choices"][0]["delta"].get("content", "") for ch in with_choices)
    # Greedy decoding: the stream and the plain completion say the same.
    assert streamed == plain["choices"][0]["message"]["content"]

    # Without include_usage there is no usage at all.
    _, text, _ = await chat(jp_fetch, {**body, "stream": True}, raw=True)
    chunks = [json.loads(p) for p in data_lines(text)[:-1]]
    assert all("usage" not in ch for ch in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


async def test_message_forms(jp_fetch):
    plain = {"messages": MESSAGES, "max_tokens": 6, "temperature": 0}
    parts = {
        "messages": [
            # Anthropic-style caching marks (LiteLLM's, for Jupyter AI): accepted, no effect.
            {
                "role": "developer",
                "content": [{"type": "text", "text": "You are terse."}],
                "cache_control": {"type": "ephemeral"},
            },
            {
                "role": "user",
                "name": "ann",
                "content": [
                    {"type": "text", "text": "Say "},
                    {
                        "type": "text",
                        "text": "something.",
                        "cache_control": {"type": "ephemeral", "ttl": "1h"},
                    },
                ],
            },
        ],
        "max_tokens": 6,
        "temperature": 0,
    }
    _, a, _ = await chat(jp_fetch, plain)
    _, b, _ = await chat(jp_fetch, parts)
    # Text parts are joined and `developer` is `system`: the model sees the same prompt.
    assert a["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"]
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
    history = {
        "messages": [
            *MESSAGES,
            {"role": "assistant", "content": "Fine.", "tool_calls": [], "refusal": None},
            {"role": "user", "content": "More."},
        ],
        "max_tokens": 3,
    }
    status, c, _ = await chat(jp_fetch, history)
    assert status == 200 and c["usage"]["prompt_tokens"] > a["usage"]["prompt_tokens"]


async def test_seed_and_neutral_values(jp_fetch):
    # A seed reproduces sampled text.
    body = {"messages": MESSAGES, "max_tokens": 10, "temperature": 1.0, "seed": 1234}
    _, a, _ = await chat(jp_fetch, body)
    _, b, _ = await chat(jp_fetch, body)
    assert a["seed"] == 1234
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]

    # Values that ask for nothing the service does not do anyway are accepted.
    status, c, _ = await chat(
        jp_fetch,
        {
            "messages": MESSAGES,
            "max_tokens": 2,
            "n": 1,
            "stop": None,
            "frequency_penalty": 0.0,
            "presence_penalty": 0,
            "logprobs": False,
            "tools": [],
            "tool_choice": "auto",
            "parallel_tool_calls": True,
            "response_format": {"type": "text"},
            "user": "someone",
            "store": False,
            "metadata": {"k": "v"},
            "service_tier": "auto",
        },
    )
    assert status == 200, c
    _, resp, _ = await call(jp_fetch, "GET", f"responses/{c['response_id']}")
    assert resp["metadata"] == {"k": "v"}


# (body, error code, error param): each gets a 400 in the LMSP shape.
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CALL = {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
# A pattern the grammar compiler refuses, strict or not.
BAD_PATTERN = {"type": "string", "pattern": "(unclosed"}

BAD_REQUESTS = [
    ({}, "missing_required_parameter", "messages"),
    ({"messages": []}, "invalid_value", "messages"),
    ({"messages": "hi"}, "invalid_value", "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "invalid_value", "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "invalid_value", "messages[0].content"),
    (
        {"messages": [{"role": "function", "content": "x", "name": "f"}]},
        "unsupported_input",
        "messages[0].role",
    ),
    ({"messages": [{"role": "tool", "content": "x"}]}, "invalid_value", "messages[0].tool_call_id"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "unsupported_input",
        "messages[0].content[0]",
    ),
    (
        {"messages": [{"role": "assistant", "content": "x", "tool_calls": [{"id": "c"}]}]},
        "invalid_value",
        "messages[0].tool_calls[0].type",
    ),
    (
        {
            "messages": [
                {"role": "assistant", "tool_calls": [{"id": "c", "type": "custom", "custom": {}}]}
            ]
        },
        "unsupported_input",
        "messages[0].tool_calls[0]",
    ),
    (
        {"messages": [{"role": "user", "content": "x", "tool_calls": [CALL]}]},
        "invalid_value",
        "messages[0].tool_calls",
    ),
    ({"messages": MESSAGES, "n": 5}, "invalid_value", "n"),
    ({"messages": MESSAGES, "n": 0}, "invalid_value", "n"),
    ({"messages": MESSAGES, "stop": ["a", "b", "c", "d", "e"]}, "invalid_value", "stop"),
    ({"messages": MESSAGES, "stop": [""]}, "invalid_value", "stop[0]"),
    ({"messages": MESSAGES, "top_logprobs": 2}, "invalid_value", "top_logprobs"),
    ({"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, "invalid_value", "top_logprobs"),
    ({"messages": MESSAGES, "tools": [{"type": "function"}]}, "invalid_value", "tools[0].function"),
    (
        {"messages": MESSAGES, "tools": [{"type": "web_search"}]},
        "unsupported_parameter",
        "tools[0]",
    ),
    ({"messages": MESSAGES, "tool_choice": "required"}, "invalid_value", "tool_choice"),
    (
        {"messages": MESSAGES, "tools": [TOOL], "tool_choice": {"type": "custom", "name": "x"}},
        "unsupported_parameter",
        "tool_choice",
    ),
    (
        {
            "messages": MESSAGES,
            "tools": [TOOL],
            "tool_choice": {"type": "function", "function": {"name": "nope"}},
        },
        "invalid_schema",
        "tool_choice",
    ),
    (
        {
            "messages": MESSAGES,
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {"type": "object", "properties": {"a": BAD_PATTERN}},
                    },
                }
            ],
        },
        "invalid_schema",
        "tools[0].function.parameters.properties.a.pattern",
    ),
    (
        {
            "messages": MESSAGES,
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "x",
                    "schema": {"type": "object", "properties": {"a": BAD_PATTERN}},
                },
            },
        },
        "invalid_schema",
        "response_format.json_schema.schema.properties.a.pattern",
    ),
    (
        {"messages": MESSAGES, "response_format": {"type": "grammar"}},
        "invalid_value",
        "response_format",
    ),
    ({"messages": MESSAGES, "max_tokens": 0}, "invalid_value", "max_tokens"),
    ({"messages": MESSAGES, "max_tokens": "8"}, "invalid_type", "max_tokens"),
    ({"messages": MESSAGES, "max_tokens": 4, "max_completion_tokens": 5}, None, "max_tokens"),
    ({"messages": MESSAGES, "temperature": 3}, "invalid_value", "temperature"),
    ({"messages": MESSAGES, "top_p": 0}, "invalid_value", "top_p"),
    ({"messages": MESSAGES, "seed": -1}, "invalid_value", "seed"),
    ({"messages": MESSAGES, "frequency_penalty": 2.5}, "invalid_value", "frequency_penalty"),
    ({"messages": MESSAGES, "presence_penalty": "x"}, "invalid_type", "presence_penalty"),
    ({"messages": MESSAGES, "logprobs": 0}, "invalid_type", "logprobs"),
    ({"messages": MESSAGES, "store": True}, "unsupported_parameter", "store"),
    (
        {"messages": MESSAGES, "stream_options": {"include_usage": True}},
        "invalid_value",
        "stream_options",
    ),
    ({"messages": MESSAGES, "colour": "blue"}, "unknown_parameter", "colour"),
    (
        {"messages": [{"role": "user", "content": "x", "cache_control": {"type": "forever"}}]},
        "invalid_value",
        "messages[0].cache_control.type",
    ),
    ({"messages": MESSAGES, "metadata": {"k": 1}}, "invalid_value", "metadata"),
]


async def test_bad_requests(jp_fetch):
    # One server for all the cases: none of them reaches the model.
    newest = await newest_task(jp_fetch)
    for body, code, param in BAD_REQUESTS:
        status, error, _ = await chat(jp_fetch, body)
        assert_error(status, error, 400, code, param)
    assert await tasks_since(jp_fetch, newest) == []

    status, error, _ = await chat(jp_fetch, "{nope")
    assert_error(status, error, 400, "invalid_json")
    status, error, _ = await chat(jp_fetch, "[1, 2]")
    assert_error(status, error, 400, "invalid_json")
    status, error, _ = await chat(jp_fetch, {"model": "nope", "messages": MESSAGES})
    assert_error(status, error, 404, "model_not_found", "model")
    assert error["error"]["type"] == "not_found_error"
    status, error, _ = await call(jp_fetch, "GET", "chat/completions")
    assert_error(status, error, 405)


async def test_idempotency_key_replays(jp_fetch):
    newest = await newest_task(jp_fetch)
    headers = {"Idempotency-Key": "chat-1"}
    body = {"messages": MESSAGES, "max_tokens": 5}
    _, first, h1 = await chat(jp_fetch, body, headers=headers)
    _, again, h2 = await chat(jp_fetch, body, headers=headers)
    assert again == first
    assert "Idempotent-Replayed" not in h1 and h2["Idempotent-Replayed"] == "true"
    status, error, _ = await chat(jp_fetch, {**body, "max_tokens": 6}, headers=headers)
    assert_error(status, error, 422, "idempotency_key_mismatch")

    # A streamed one is replayed from the task's stored events: the same chunks.
    headers = {"Idempotency-Key": "chat-2"}
    body = {"messages": MESSAGES, "max_tokens": 5, "stream": True}
    _, text1, _ = await chat(jp_fetch, body, headers=headers, raw=True)
    _, text2, h2 = await chat(jp_fetch, body, headers=headers, raw=True)
    assert h2["Idempotent-Replayed"] == "true"
    assert data_lines(text1) == data_lines(text2)
    assert len(await tasks_since(jp_fetch, newest)) == 2  # nothing new was started


@pytest.mark.token_delay(0.02)
async def test_cancelled_by_the_task_api(jp_fetch):
    # A stream's first chunk arrives once the task is committed and names it.
    first = asyncio.get_running_loop().create_future()
    received: list[bytes] = []

    def on_data(data: bytes) -> None:
        received.append(data)
        if not first.done():
            first.set_result(None)

    body = {"messages": LONG_PROMPT, "max_tokens": LONG, "temperature": 0, "stream": True}
    stream = asyncio.ensure_future(
        jp_fetch(
            "lmsp",
            "v1",
            "chat",
            "completions",
            method="POST",
            body=json.dumps(body),
            streaming_callback=on_data,
        )
    )
    await asyncio.wait_for(first, 30)
    head = json.loads(data_lines(b"".join(received).decode())[0])
    await wait_state(jp_fetch, head["task_id"], {"running"}, timeout=30)
    status, _, _ = await call(jp_fetch, "POST", f"tasks/{head['task_id']}/cancel")
    assert status == 200
    await asyncio.wait_for(stream, 30)
    payloads = data_lines(b"".join(received).decode())
    assert payloads[-1] == "[DONE]"
    error = json.loads(payloads[-2])
    assert_error(409, error, 409, "response_cancelled")
    assert all(json.loads(p)["choices"][0]["finish_reason"] is None for p in payloads[:-2])
    await wait_state(jp_fetch, head["task_id"], {"cancelled"}, timeout=30)


@pytest.mark.token_delay(0.02)
async def test_client_going_away_cancels_the_task(jp_fetch):
    body = {"messages": LONG_PROMPT, "max_tokens": LONG, "temperature": 0}
    with pytest.raises(HTTPClientError) as e:
        await jp_fetch(
            "lmsp",
            "v1",
            "chat",
            "completions",
            method="POST",
            body=json.dumps(body),
            request_timeout=1.0,
        )
    assert e.value.code == 599  # the client gave up
    _, page, _ = await call(jp_fetch, "GET", "tasks", params={"limit": 1})
    [task] = page["data"]
    task = await wait_state(jp_fetch, task["id"], {"cancelled", "completed"}, timeout=30)
    assert task["state"] == "cancelled"


@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("seed", [None, 7])
def test_a_text_chunk_from_its_template_is_the_chunk_object_serialized(include_usage, seed):
    """Issue 42: a text delta's chunk is serialized from a template made once per stream; it
    is the JSON the handler writes for `chunk_object`'s chunk, character for character."""
    from jupyter_lmsp.protocol.chat import ChunkChoice, ChunkDelta, chunk_object
    from jupyter_lmsp.services.chat import ContentChunks

    head = {
        "id": "resp_0123",
        "task_id": "task_0123",
        "created_at": 1765000000,
        "model": 'tiny "q" é',
        "seed": seed,
    }
    content = ContentChunks(head, include_usage)
    for choice, text in [(0, 'hé"llo\n\\'), (3, ""), (1, "\u2028 \x00 🙂")]:
        wire = chunk_object(
            head,
            choices=[ChunkChoice(index=choice, delta=ChunkDelta(content=text), finish_reason=None)],
            include_usage=include_usage,
        )
        assert content.chunk(choice, text) == json.dumps(wire, separators=(",", ":"))
