"""The OpenAPI 3.1 document (`GET /lmsp/v1/openapi.json`) is kept true: it is valid OpenAPI 3.1,
documents exactly the routes of handlers/routes.py with their methods and scopes, its request
schemas (generated from the same pydantic models the handlers validate with) accept exactly
what the handlers accept on a table of bodies, and real answers of a running server (jp_fetch)
validate against its response schemas."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
from typing import Any

import pytest
from jpserver import call, server_config
from jsonschema import Draft202012Validator
from openapi_spec_validator import OpenAPIV31SpecValidator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012
from serverproc import MODEL
from tornado import web
from tornado.httpclient import HTTPClientError

from jupyter_lmsp.handlers.base import operation_of
from jupyter_lmsp.handlers.routes import TABLE, endpoints, path_extensions
from jupyter_lmsp.protocol.chat import CreateChatCompletionRequest
from jupyter_lmsp.protocol.errors import LMSPError
from jupyter_lmsp.protocol.openapi import openapi_document
from jupyter_lmsp.protocol.responses import CreateResponseRequest
from jupyter_lmsp.protocol.validation import parse_json, validate

pytest_plugins = ["pytest_jupyter.jupyter_server"]
pytestmark = pytest.mark.timeout(120)

METHODS = ("get", "post", "put", "patch", "delete")
DOC_URI = "urn:lmsp:openapi"

DOC = openapi_document(endpoints(), path_extensions=path_extensions())


def validator(name: str) -> Draft202012Validator:
    """A validator for `#/components/schemas/{name}`, resolving refs inside the document."""
    registry: Registry = Registry().with_resource(
        DOC_URI, Resource.from_contents(DOC, default_specification=DRAFT202012)
    )
    return Draft202012Validator(
        {"$ref": f"{DOC_URI}#/components/schemas/{name}"}, registry=registry
    )


def assert_valid(name: str, instance: Any) -> None:
    errors = sorted(validator(name).iter_errors(instance), key=lambda e: list(e.path))
    assert not errors, f"{name}: " + "; ".join(
        f"{list(e.absolute_path)}: {e.message}" for e in errors[:5]
    )


# -- the document itself --------------------------------------------------------------------


def test_document_is_valid_openapi_31():
    OpenAPIV31SpecValidator(DOC).validate()
    assert DOC["openapi"].startswith("3.1")
    ids = [
        op["operationId"]
        for item in DOC["paths"].values()
        for name, op in item.items()
        if not name.startswith("x-")
    ]
    assert len(ids) == len(set(ids))


def test_every_handler_method_is_a_documented_operation():
    """No route method escapes the declaration (an undeclared method would be neither
    authorized nor documented), and each documented operation says what its declaration
    enforces."""
    for path, handler in TABLE:
        documented = DOC["paths"][path]
        for name in METHODS:
            method = getattr(handler, name)
            if name == "get" and handler.websocket_get:
                # Only opens the WebSocket mode: stated as the spec states it, no operation.
                assert "get" not in documented and "x-openresponses-websocket" in documented
                continue
            if method is getattr(web.RequestHandler, name):
                assert name not in documented, f"{name.upper()} {path}"
                continue
            op = operation_of(method)
            assert op is not None, f"{name.upper()} {path} has no @operation"
            doc = documented[name]
            assert (doc.get("security") == []) == op.public
            if op.scope:
                assert {"bearer": [op.scope]} in doc["security"]
                assert "403" in doc["responses"]
            params = [p for p in doc.get("parameters", []) if p.get("in") == "path"]
            assert [p["name"] for p in params] == re.findall(r"\{(\w+)\}", path)
            assert "401" in doc["responses"] or op.public


def test_every_field_of_the_openai_requests_is_known():
    """A field the openai SDK (3.57) can send is never `unknown_parameter`: it is honoured,
    accepted when neutral, or refused by name as `unsupported_parameter`."""
    from openai.types.chat.completion_create_params import CompletionCreateParamsBase
    from openai.types.responses.response_create_params import (
        ResponseCreateParamsBase,
        ResponseCreateParamsStreaming,
    )

    responses = set(ResponseCreateParamsBase.__annotations__)
    responses |= set(ResponseCreateParamsStreaming.__annotations__)
    assert responses <= set(CreateResponseRequest.model_fields)
    chat = set(CompletionCreateParamsBase.__annotations__) | {"stream"}
    assert chat <= set(CreateChatCompletionRequest.model_fields)


def test_request_schemas_name_every_accepted_field():
    responses = DOC["components"]["schemas"]["CreateResponseRequest"]["properties"]
    assert set(responses) == set(CreateResponseRequest.model_fields)
    chat = DOC["components"]["schemas"]["CreateChatCompletionRequest"]["properties"]
    assert set(chat) == set(CreateChatCompletionRequest.model_fields)


MSG = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
CALL = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
# (body, accepted): the schema and the parser must agree on each.
CHAT_BODIES: list[tuple[dict[str, Any], bool]] = [
    ({"messages": MSG}, True),
    ({"messages": MSG, "model": None, "max_tokens": None, "stop": None, "n": None}, True),
    ({"messages": [{"role": "developer", "content": [{"type": "text", "text": "x"}]}]}, True),
    ({"messages": [{"role": "assistant", "content": "x", "tool_calls": []}]}, True),
    ({"messages": [{"role": "user", "content": "x", "name": "ann"}]}, True),
    ({"messages": MSG, "max_completion_tokens": 3, "temperature": 0, "top_p": 1}, True),
    ({"messages": MSG, "seed": 2**63 - 1, "n": 1, "stop": []}, True),
    ({"messages": MSG, "stream": True, "stream_options": {"include_usage": True}}, True),
    ({"messages": MSG, "frequency_penalty": 0.0, "logprobs": False, "tools": []}, True),
    ({"messages": MSG, "tool_choice": "none", "response_format": {"type": "text"}}, True),
    ({"messages": MSG, "metadata": {"a": "b"}, "store": False, "user": "u"}, True),
    ({}, False),
    ({"messages": []}, False),
    ({"messages": [{"role": "tool", "content": "x"}]}, False),
    ({"messages": [{"role": "tool", "content": "x", "tool_call_id": ""}]}, False),
    ({"messages": [{"role": "tool", "content": "x", "tool_call_id": "c"}]}, True),
    ({"messages": [{"role": "function", "content": "x", "name": "f"}]}, False),
    ({"messages": [{"role": "assistant", "tool_calls": [CALL]}]}, True),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [CALL]}]}, True),
    ({"messages": [{"role": "assistant", "tool_calls": []}]}, False),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [CALL]}]}, False),
    ({"messages": [{"role": "assistant"}]}, False),
    ({"messages": [{"role": "user", "content": None}]}, False),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, False),
    ({"messages": [{"role": "user", "content": "x", "extra": 1}]}, False),
    ({"messages": [{"role": "assistant", "content": "x", "tool_calls": [{}]}]}, False),
    ({"messages": MSG, "max_tokens": 0}, False),
    ({"messages": MSG, "max_tokens": True}, False),
    ({"messages": MSG, "temperature": 2.5}, False),
    ({"messages": MSG, "top_p": 0}, False),
    ({"messages": MSG, "seed": 2**63}, False),
    ({"messages": MSG, "seed": -1}, False),
    ({"messages": MSG, "n": 2, "stop": "x", "logprobs": True, "top_logprobs": 3}, True),
    ({"messages": MSG, "n": 0}, False),
    ({"messages": MSG, "stop": ["a", "b", "c", "d", "e"]}, False),
    ({"messages": MSG, "stop": ""}, False),
    ({"messages": MSG, "top_logprobs": 3}, False),
    ({"messages": MSG, "top_logprobs": 0}, True),
    ({"messages": MSG, "logprobs": True, "top_logprobs": 21}, False),
    ({"messages": MSG, "tool_choice": "required"}, False),
    ({"messages": MSG, "tool_choice": "required", "tools": [TOOL]}, True),
    ({"messages": MSG, "tool_choice": {"type": "function", "function": {"name": "f"}}}, False),
    ({"messages": MSG, "tools": [{"type": "custom", "custom": {}}]}, False),
    ({"messages": MSG, "response_format": {"type": "json_object"}}, True),
    (
        {
            "messages": MSG,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": True},
            },
        },
        True,
    ),
    ({"messages": MSG, "response_format": {"type": "json_schema"}}, False),
    ({"messages": MSG, "frequency_penalty": 1, "presence_penalty": -2}, True),
    ({"messages": MSG, "frequency_penalty": 2.5}, False),
    ({"messages": MSG, "presence_penalty": "x"}, False),
    ({"messages": MSG, "logprobs": 0}, False),
    ({"messages": MSG, "parallel_tool_calls": 1}, False),
    ({"messages": MSG, "store": True}, False),
    ({"messages": MSG, "metadata": {"a": 1}}, False),
    ({"messages": MSG, "metadata": {f"k{i}": "v" for i in range(17)}}, False),
    ({"messages": MSG, "stream": True, "stream_options": {"other": 1}}, False),
    ({"messages": MSG, "prediction": {"type": "content"}}, False),
    ({"messages": MSG, "max_tokens": 3.0}, True),
    ({"messages": MSG, "stream_options": None}, True),
    ({"messages": MSG, "stream_options": {}}, False),
    ({"messages": MSG, "stream": False, "stream_options": {"include_usage": True}}, False),
    ({"messages": MSG, "stream": True, "stream_options": {"include_obfuscation": 0}}, False),
    ({"messages": MSG, "unknown": 1}, False),
]
RESPONSE_BODIES: list[tuple[dict[str, Any], bool]] = [
    ({"input": "hi"}, True),
    ({"input": MSG, "instructions": "be brief", "max_output_tokens": 5}, True),
    (
        {
            "input": [
                {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "x"}],
                }
            ]
        },
        True,
    ),
    ({"input": "x", "tools": [], "tool_choice": "auto", "truncation": "disabled"}, True),
    ({"input": "x", "on_restart": "retry", "seed": 0, "metadata": {"a": "b"}}, True),
    ({"input": "x", "text": {"format": {"type": "text"}}, "include": None}, True),
    ({}, False),
    ({"input": 3}, False),
    ({"input": []}, False),
    ({"input": [{"type": "function_call"}]}, False),
    (
        {
            "input": [
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c", "output": "42"},
            ]
        },
        True,
    ),
    ({"input": [{"type": "reasoning", "summary": []}]}, True),
    ({"input": [{"type": "reasoning", "summary": [], "content": [{"type": "x"}]}]}, False),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, False),
    ({"input": "x", "max_output_tokens": 0}, False),
    ({"input": "x", "on_restart": "never"}, False),
    ({"input": "x", "tools": [{"type": "web_search"}]}, False),
    ({"input": "x", "tool_choice": "required"}, False),
    ({"input": "x", "tool_choice": "required", "tools": [{"type": "function", "name": "f"}]}, True),
    ({"input": "x", "tool_choice": {"type": "function", "name": "f"}, "tools": []}, False),
    ({"input": "x", "text": {"format": {"type": "json_object"}}, "stop": ["\n"]}, True),
    (
        {"input": "x", "text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}},
        True,
    ),
    ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {}}}}, False),
    ({"input": "x", "include": ["message.output_text.logprobs"], "top_logprobs": 3}, True),
    ({"input": "x", "include": ["reasoning.encrypted_content"]}, True),
    ({"input": "x", "include": ["file_search_call.results"]}, False),
    ({"input": "x", "reasoning": {"summary": "auto"}, "presence_penalty": 0}, True),
    ({"input": "x", "presence_penalty": 0.5, "frequency_penalty": -1.5}, True),
    ({"input": "x", "presence_penalty": -2.5}, False),
    ({"input": "x", "frequency_penalty": "x"}, False),
    ({"input": "x", "truncation": "auto"}, True),
    ({"input": "x", "truncation": "middle"}, False),
    ({"input": "x", "user": "someone", "safety_identifier": "s", "prompt_cache_key": "k"}, True),
    ({"input": "x", "service_tier": "auto", "top_logprobs": 0, "max_tool_calls": None}, True),
    ({"input": "x", "text": {"verbosity": "medium"}, "conversation": None}, True),
    ({"input": "x", "stream_options": {"include_obfuscation": False}, "stream": True}, True),
    ({"input": "x", "background": True, "stream": True}, True),
    ({"input": "x", "text": {"verbosity": "low"}}, False),
    ({"input": "x", "top_logprobs": 3}, False),
    ({"input": "x", "top_logprobs": 3, "include": []}, False),
    ({"input": "x", "conversation": "conv_1"}, True),
    ({"input": "x", "conversation": {"id": "conv_1"}}, True),
    ({"input": "x", "conversation": {"id": 1}}, False),
    ({"input": "x", "conversation": "c", "previous_response_id": "r"}, False),
    ({"input": "x", "conversation": "c", "previous_response_id": None}, True),
    ({"input": "x", "user": 3}, False),
    ({"input": "x", "seed": -5}, False),
    ({"input": "x", "colour": 1}, False),
    ({"input": "x", "max_output_tokens": 4.0}, True),
    ({"input": "x", "background": True, "store": True}, True),
    ({"input": "x", "background": None, "store": False}, True),
    ({"input": "x", "background": True, "store": False}, False),
    ({"input": "x", "parallel_tool_calls": 0}, False),
]


def accepted(model: Any, body: dict[str, Any]) -> bool:
    try:
        validate(model, parse_json(json.dumps(body).encode()))
    except LMSPError as e:
        assert e.status == 400
        return False
    return True


@pytest.mark.parametrize(
    ("model", "bodies"),
    [(CreateChatCompletionRequest, CHAT_BODIES), (CreateResponseRequest, RESPONSE_BODIES)],
)
def test_request_schemas_agree_with_validation(model, bodies):
    """JSON Schema and pydantic read the same model; where their semantics could part
    (integral floats, `0` against `false`, neutral values, rules across fields) they agree."""
    check = validator(model.__name__)
    for body, expected in bodies:
        assert check.is_valid(body) is expected, f"schema on {body}"
        assert accepted(model, body) is expected, f"validation on {body}"


# -- against a running server ---------------------------------------------------------------


@pytest.fixture
def jp_server_config(lmsp_data, request):
    return server_config(lmsp_data, request)


async def wait_task(jp_fetch, task_id: str) -> dict[str, Any]:
    for _ in range(600):
        _, task, _ = await call(jp_fetch, "GET", f"tasks/{task_id}")
        assert_valid("Task", task)
        if task["state"] in ("completed", "failed", "cancelled"):
            return task
        await asyncio.sleep(0.05)
    raise AssertionError(f"task {task_id} did not finish")


async def test_served_document_and_real_answers_match(
    jp_fetch, jp_base_url, http_server_client, test_model_dir, tmp_path
):
    # Served without credentials, with this server's mount point.
    raw = await http_server_client.fetch(f"{jp_base_url}lmsp/v1/openapi.json")
    served = json.loads(raw.body)
    OpenAPIV31SpecValidator(served).validate()
    assert served["servers"] == [{"url": f"{jp_base_url.rstrip('/')}/lmsp/v1"}]
    assert served["paths"] == DOC["paths"]
    assert served["components"] == DOC["components"]

    status, service, _ = await call(jp_fetch, "GET", "service")
    assert_valid("Service", service)
    _, models, _ = await call(jp_fetch, "GET", "models")
    assert_valid("ModelList", models)
    assert models["data"]
    _, model, _ = await call(jp_fetch, "GET", f"models/{MODEL}")
    assert_valid("Model", model)
    # A copy: the test model's own folder is registered already (as MODEL), and a folder is
    # registered under one id only.
    copy = shutil.copytree(test_model_dir, tmp_path / "copy")
    status, registering, _ = await call(
        jp_fetch, "POST", "models", {"source": str(copy), "id": "copy"}
    )
    assert status == 202
    assert_valid("Task", registering)
    assert (await wait_task(jp_fetch, registering["id"]))["state"] == "completed"
    _, deleted, _ = await call(jp_fetch, "DELETE", "models/copy")
    assert_valid("ModelDeleted", deleted)

    status, queued, _ = await call(
        jp_fetch,
        "POST",
        "responses",
        {"input": "Hello", "background": True, "max_output_tokens": 6, "metadata": {"k": "v"}},
    )
    assert status == 202
    assert_valid("Response", queued)
    task_id = queued["task_id"]
    await wait_task(jp_fetch, task_id)
    _, done, _ = await call(jp_fetch, "GET", f"responses/{queued['id']}")
    assert_valid("Response", done)
    assert done["output"] and done["usage"]
    _, page, _ = await call(jp_fetch, "GET", f"tasks/{task_id}/events", params={"limit": 1000})
    assert_valid("EventPage", page)
    _, tasks, _ = await call(jp_fetch, "GET", "tasks")
    assert_valid("TaskList", tasks)
    _, items, _ = await call(jp_fetch, "GET", f"responses/{queued['id']}/input_items")
    assert_valid("InputItemList", items)

    _, completion, _ = await call(
        jp_fetch, "POST", "chat/completions", {"messages": MSG, "max_tokens": 4}
    )
    assert_valid("ChatCompletion", completion)
    stream = await jp_fetch(
        "lmsp",
        "v1",
        "chat",
        "completions",
        method="POST",
        body=json.dumps(
            {
                "messages": MSG,
                "max_tokens": 4,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        ),
    )
    lines = [ln[6:] for ln in stream.body.decode().splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    for line in lines[:-1]:
        assert_valid("ChatCompletionChunk", json.loads(line))

    _, cancelled, _ = await call(jp_fetch, "POST", f"tasks/{task_id}/cancel", {})
    assert_valid("Task", cancelled)
    _, deleted, _ = await call(jp_fetch, "DELETE", f"responses/{queued['id']}")
    assert_valid("ResponseDeleted", deleted)
    _, clients, _ = await call(jp_fetch, "GET", "clients")
    assert_valid("ClientList", clients)
    _, pairings, _ = await call(jp_fetch, "GET", "pairings")
    assert_valid("PairingList", pairings)

    # Errors, from the parsers, the store and Tornado itself, in the documented shape.
    for method, path, body, expected in [
        ("GET", "tasks/task_nope", None, 404),
        ("GET", "responses/resp_nope", None, 404),
        ("POST", "responses", {"input": 3}, 400),
        ("POST", "responses", {"input": "x", "model": "nope"}, 404),
        ("POST", "chat/completions", {"messages": MSG, "n": 5}, 400),
        ("GET", "tasks", None, 400),
        ("PUT", "tasks", {}, 405),
        ("POST", "models", {"source": "/nowhere/at/all"}, 404),
        ("POST", "models", {"source": " "}, 400),
        # Found by the fuzzer: these raised from pathlib (500) before.
        ("POST", "models", {"source": "~no_such_user_here/model"}, 404),
        ("POST", "models", {"source": "m" * 5000}, 404),
        ("DELETE", "models/model_nope", None, 404),
    ]:
        params = {"limit": 0} if path == "tasks" and method == "GET" else None
        status, error, _ = await call(jp_fetch, method, path, body, params=params)
        assert status == expected, (method, path, error)
        assert_valid("Error", error)
        if method != "PUT":
            op = DOC["paths"][_template(path)][method.lower()]
            assert str(status) in op["responses"], (method, path, status)
    # A 405 says what is allowed (RFC 9110).
    with pytest.raises(HTTPClientError) as e:
        await jp_fetch("lmsp", "v1", "responses", method="PUT", body="{}")
    assert e.value.code == 405 and e.value.response.headers["Allow"] == "POST"
    # Paths no route matches: an LMSP 404 too, not Jupyter's HTML page.
    for path in ("lmsp/v1/nothing/here", "lmsp/v1/tasks/b%C3%A4d", "lmsp/v1/models/a%20b"):
        for method in ("GET", "POST"):
            response = await http_server_client.fetch(
                f"{jp_base_url}{path}",
                method=method,
                body="{}" if method == "POST" else None,
                raise_error=False,
            )
            assert response.code == 404, (method, path, response.code)
            assert response.headers["Content-Type"] == "application/json"
            assert_valid("Error", json.loads(response.body))


def _template(path: str) -> str:
    """`tasks/task_nope` → the documented `/tasks/{task_id}`."""
    wanted = re.sub(r"[a-z]+_[A-Za-z0-9]+", "{}", "/" + path)
    for documented in DOC["paths"]:
        if re.sub(r"\{[^}]+\}", "{}", documented) == wanted:
            return documented
    raise KeyError(path)
