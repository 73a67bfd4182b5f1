"""The service's OpenAPI 3.1 document (LMSP B1), served at `GET /lmsp/v1/openapi.json`.

Built here as a plain dict: every route of handlers/routes.py with its methods, parameters,
request bodies and responses, and JSON Schemas (2020-12, the dialect of OpenAPI 3.1) for the wire
objects. The request schemas follow what protocol/requests.py and protocol/chat.py accept, and
the tables of neutral values are read from those modules, so the two cannot drift apart
silently; tests/test_openapi.py checks the rest against the routes and against real answers.
"""

from __future__ import annotations

from typing import Any

from ..auth.scopes import SCOPES
from .chat import NEUTRAL_MESSAGE_FIELDS, NEUTRAL_VALUES
from .requests import HARMLESS_DEFAULTS, MAX_METADATA_KEYS
from .states import RestartPolicy, TaskState

Schema = dict[str, Any]

OPENAPI_VERSION = "3.1.0"
ID_PATTERN = "^[A-Za-z0-9_.-]+$"
SSE = "text/event-stream"
JSON = "application/json"

RESPONSE_STATUSES = ["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]
ROLES = ["user", "assistant", "system", "developer"]


def _ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


def _nullable(schema: Schema) -> Schema:
    return {"anyOf": [schema, {"type": "null"}]}


def _json_content(schema: Schema) -> dict[str, Any]:
    return {JSON: {"schema": schema}}


def _sse_content(item: str) -> dict[str, Any]:
    # OpenAPI 3.1 has no standard way to describe a stream; `schema` describes each event,
    # read as an object of its fields (`id`, `event`, `data`), as OpenAPI 3.2's `itemSchema`
    # does and schemathesis expects.
    return {SSE: {"schema": _ref(item)}}


def _errors(*statuses: int) -> dict[str, Any]:
    return {
        str(status): {"$ref": f"#/components/responses/{ERRORS[status][0]}"} for status in statuses
    }


# status → (component name, description)
ERRORS: dict[int, tuple[str, str]] = {
    400: ("BadRequest", "Invalid input: a malformed body, a bad value, an unsupported parameter."),
    401: ("Unauthorized", "No or bad credentials (`WWW-Authenticate: Bearer`)."),
    403: (
        "Forbidden",
        "The credentials lack a scope (`insufficient_scope`), or the XSRF check failed.",
    ),
    404: ("NotFound", "No such object (or it belongs to another client)."),
    409: (
        "Conflict",
        "An `Idempotency-Key` still in use (`Retry-After`), or a cancelled chat completion.",
    ),
    413: ("TooLarge", "The request body is over the configured limit."),
    422: ("Unprocessable", "An `Idempotency-Key` reused with a different request."),
    429: (
        "TooManyRequests",
        "Too many credential-free requests from this address (`Retry-After`).",
    ),
    500: ("ServerError", "The generation failed (chat completions only; never on bad input)."),
}

# operationId → the scope its handler requires (handlers' `@requires`); tests/test_openapi.py
# checks the two agree.
OPERATION_SCOPES = {
    "listModels": "models:read",
    "registerModel": "models:write",
    "getModel": "models:read",
    "deleteModel": "models:write",
    "createResponse": "responses:write",
    "getResponse": "responses:read",
    "deleteResponse": "responses:write",
    "cancelResponse": "responses:write",
    "listInputItems": "responses:read",
    "listTasks": "tasks:read",
    "getTask": "tasks:read",
    "cancelTask": "tasks:write",
    "listTaskEvents": "tasks:read",
    "createChatCompletion": "responses:write",
    "listPairings": "clients:admin",
    "approvePairing": "clients:admin",
    "denyPairing": "clients:admin",
    "listClients": "clients:admin",
    "revokeClient": "clients:admin",
}

ERROR_HEADERS: dict[int, dict[str, Any]] = {
    401: {
        "WWW-Authenticate": {
            "description": '`Bearer realm="lmsp"`.',
            "required": True,
            "schema": {"type": "string"},
        }
    },
    429: {
        "Retry-After": {
            "description": "Seconds to wait before retrying.",
            "required": True,
            "schema": {"type": "string"},
        }
    },
    409: {
        "Retry-After": {
            "description": "Seconds to wait before retrying.",
            "schema": {"type": "string"},
        }
    },
}

AUTHED = (401, 403)
POSTED = (400, 401, 403, 409, 413, 422)


def _idempotency_header() -> Schema:
    return {"$ref": "#/components/parameters/IdempotencyKey"}


def _path_id(name: str, what: str) -> Schema:
    return {
        "name": name,
        "in": "path",
        "required": True,
        "description": f"The {what}'s id.",
        "schema": {"type": "string", "pattern": ID_PATTERN},
    }


def _query(name: str, schema: Schema, description: str, **extra: Any) -> Schema:
    param = {
        "name": name,
        "in": "query",
        "required": False,
        "description": description,
        "schema": schema,
    }
    if schema.get("type") == "integer":
        # The handlers' integer arguments read an empty value as an absent one.
        param["allowEmptyValue"] = True
    return param | extra


def _stream_flag(description: str) -> Schema:
    # The handlers read `true`/`false`/`1`/`0`; documented as a boolean.
    return _query("stream", {"type": "boolean"}, description)


# ---------------------------------------------------------------------------------------------
# schemas of the wire objects


def _metadata_schema() -> Schema:
    return {
        "type": "object",
        "maxProperties": MAX_METADATA_KEYS,
        "propertyNames": {"maxLength": 64},
        "additionalProperties": {"type": "string", "maxLength": 512},
        "description": "At most 16 string keys (64 characters) with string values (512 characters).",
    }


def _harmless(allowed: Any) -> Schema:
    """The schema of a Responses field accepted only with neutral values (requests.py:
    a tuple lists the accepted values; otherwise the value itself or null)."""
    if isinstance(allowed, tuple):
        return {"enum": list(allowed), "description": "Accepted only with these values."}
    if allowed is None:
        return {"type": "null", "description": "Accepted only as null (not supported)."}
    return {
        "anyOf": [{"const": allowed}, {"type": "null"}],
        "description": "Accepted only with this value.",
    }


def _neutral(allowed: tuple[Any, ...]) -> Schema:
    """The schema of a chat field accepted only with neutral values (chat.py: these or null)."""
    if not allowed:
        return {"type": "null", "description": "Accepted only as null (not supported)."}
    return {
        "anyOf": [*({"const": v} for v in allowed), {"type": "null"}],
        "description": "Accepted only with these values (they change nothing).",
    }


def _usage() -> Schema:
    return {
        "type": "object",
        "required": [
            "input_tokens",
            "input_tokens_details",
            "output_tokens",
            "output_tokens_details",
            "total_tokens",
        ],
        "properties": {
            "input_tokens": {"type": "integer", "minimum": 0},
            "input_tokens_details": {
                "type": "object",
                "required": ["cached_tokens", "cache_write_tokens"],
                "properties": {
                    "cached_tokens": {"type": "integer", "minimum": 0},
                    "cache_write_tokens": {"type": "integer", "minimum": 0},
                },
            },
            "output_tokens": {"type": "integer", "minimum": 0},
            "output_tokens_details": {
                "type": "object",
                "required": ["reasoning_tokens"],
                "properties": {"reasoning_tokens": {"type": "integer", "minimum": 0}},
            },
            "total_tokens": {"type": "integer", "minimum": 0},
        },
    }


def _output_message() -> Schema:
    return {
        "type": "object",
        "required": ["id", "type", "role", "status", "content"],
        "properties": {
            "id": {"type": "string"},
            "type": {"const": "message"},
            "role": {"const": "assistant"},
            "status": {"enum": ["in_progress", "completed", "incomplete"]},
            "content": {"type": "array", "items": _ref("OutputText")},
        },
    }


def _output_text() -> Schema:
    return {
        "type": "object",
        "required": ["type", "text", "annotations"],
        "properties": {
            "type": {"const": "output_text"},
            "text": {"type": "string"},
            "annotations": {"type": "array"},
            "logprobs": {"type": "array"},
        },
    }


def _response() -> Schema:
    string_or_null = {"type": ["string", "null"]}
    return {
        "type": "object",
        "description": "A response, shaped as in the OpenAI Responses API, with LMSP fields "
        "`task_id`, `seed` and `on_restart`. `status` follows its task's state.",
        "required": [
            "id",
            "object",
            "created_at",
            "status",
            "model",
            "output",
            "parallel_tool_calls",
            "tool_choice",
            "tools",
            "error",
            "incomplete_details",
            "usage",
            "metadata",
            "task_id",
            "on_restart",
        ],
        "properties": {
            "id": {"type": "string", "pattern": "^resp_"},
            "object": {"const": "response"},
            "created_at": {"type": "integer"},
            "status": {"enum": RESPONSE_STATUSES},
            "background": {"type": "boolean"},
            "error": _nullable(
                {
                    "type": "object",
                    "required": ["code", "message"],
                    "properties": {"code": {"type": "string"}, "message": {"type": "string"}},
                }
            ),
            "incomplete_details": _nullable(
                {
                    "type": "object",
                    "required": ["reason"],
                    "properties": {"reason": {"type": "string"}},
                }
            ),
            "instructions": string_or_null,
            "max_output_tokens": {"type": ["integer", "null"]},
            "model": {"type": "string"},
            "output": {"type": "array", "items": _ref("OutputMessage")},
            "parallel_tool_calls": {"type": "boolean"},
            "previous_response_id": string_or_null,
            "temperature": {"type": ["number", "null"]},
            "top_p": {"type": ["number", "null"]},
            "tool_choice": {"type": "string"},
            "tools": {"type": "array", "maxItems": 0},
            "text": {"type": "object"},
            "truncation": {"type": "string"},
            "usage": _nullable(_ref("Usage")),
            "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
            "store": {"type": "boolean"},
            "completed_at": {"type": ["integer", "null"]},
            "task_id": {"type": "string", "pattern": "^task_"},
            "seed": {"type": ["integer", "null"]},
            "on_restart": {"enum": [p.value for p in RestartPolicy]},
        },
    }


def _task() -> Schema:
    return {
        "type": "object",
        "description": "An asynchronous task: every response is generated by one.",
        "required": [
            "id",
            "object",
            "kind",
            "state",
            "on_restart",
            "last_sequence_number",
            "created_at",
            "updated_at",
            "finished_at",
            "error",
        ],
        "properties": {
            "id": {"type": "string", "pattern": "^task_"},
            "object": {"const": "task"},
            "kind": {"type": "string", "examples": ["response"]},
            "state": {"enum": [s.value for s in TaskState]},
            "on_restart": {"enum": [p.value for p in RestartPolicy]},
            "model": {"type": ["string", "null"]},
            "response_id": {"type": ["string", "null"]},
            "owner": {"type": "string"},
            "error": _nullable({"type": "object", "required": ["code", "message"]}),
            "last_sequence_number": {"type": "integer", "minimum": -1},
            "attempts": {"type": "integer", "minimum": 0},
            "created_at": {"type": "number"},
            "updated_at": {"type": "number"},
            "finished_at": {"type": ["number", "null"]},
        },
    }


def _event() -> Schema:
    return {
        "type": "object",
        "description": "One event of a task's log. `sequence_number` starts at 0 and grows by "
        "exactly 1; the first event is `response.created`, the last exactly one terminal event "
        "(`response.completed`, `.incomplete`, `.failed`, `.cancelled`). Lifecycle events carry "
        "the whole response as `response`; text arrives as `response.output_text.delta`.",
        "required": ["type", "sequence_number"],
        "properties": {
            "type": {
                "type": "string",
                "examples": ["response.created", "response.output_text.delta"],
            },
            "sequence_number": {"type": "integer", "minimum": 0},
            "response": _ref("Response"),
            "item_id": {"type": "string"},
            "output_index": {"type": "integer", "minimum": 0},
            "content_index": {"type": "integer", "minimum": 0},
            "delta": {"type": "string"},
            "text": {"type": "string"},
        },
    }


def _list_of(item: str, *, cursor: bool = True) -> Schema:
    properties: dict[str, Any] = {
        "object": {"const": "list"},
        "data": {"type": "array", "items": _ref(item)},
    }
    required = ["object", "data"]
    if cursor:
        properties |= {
            "first_id": {"type": ["string", "null"]},
            "last_id": {"type": ["string", "null"]},
            "has_more": {"type": "boolean"},
        }
        required += ["first_id", "last_id", "has_more"]
    return {"type": "object", "required": required, "properties": properties}


def _event_page() -> Schema:
    return {
        "type": "object",
        "required": ["object", "data", "has_more", "last_sequence_number"],
        "properties": {
            "object": {"const": "list"},
            "data": {"type": "array", "items": _ref("Event")},
            "has_more": {"type": "boolean"},
            "last_sequence_number": {"type": "integer", "minimum": -1},
        },
    }


def _error() -> Schema:
    return {
        "type": "object",
        "description": "Every error the service answers with (LMSP B1).",
        "required": ["error"],
        "additionalProperties": False,
        "properties": {
            "error": {
                "type": "object",
                "required": ["type", "code", "message", "param"],
                "properties": {
                    "type": {
                        "type": "string",
                        "examples": ["invalid_request_error", "not_found_error"],
                    },
                    "code": {"type": "string"},
                    "message": {"type": "string"},
                    "param": {"type": ["string", "null"]},
                },
            }
        },
    }


def _service() -> Schema:
    return {
        "type": "object",
        "required": [
            "object",
            "id",
            "name",
            "protocol",
            "version",
            "capabilities",
            "default_model",
            "limits",
        ],
        "properties": {
            "object": {"const": "service"},
            "id": {"type": "string"},
            "name": {"type": "string"},
            "protocol": {"const": "lmsp/1.0"},
            "version": {"type": "string"},
            "capabilities": {"type": "array", "items": {"type": "string"}},
            "default_model": {"type": ["string", "null"]},
            "limits": {"type": "object"},
            "blas": _blas(),
        },
    }


def _blas() -> Schema:
    number = {"type": ["number", "null"]}
    text = {"type": ["string", "null"]}
    return {
        "type": ["object", "null"],
        "description": "The inference worker's BLAS: chosen by probing candidates for "
        "correctness and speed (`choosing` until then). Host paths only under `paths`.",
        "required": ["state"],
        "properties": {
            "state": {"enum": ["choosing", "chosen"]},
            "name": {"type": "string"},
            "config": text,
            "corename": text,
            "threads": {"type": ["integer", "null"]},
            "threads_requested": {"type": ["integer", "null"]},
            "coretype": text,
            "only": {"type": "array", "items": {"type": "string"}},
            "reason": {"type": "string"},
            "probe_seconds": {"type": "number"},
            "probed_at": text,
            "cached": {"type": "boolean"},
            "candidates": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["name", "verdict", "chosen", "reason"],
                    "properties": {
                        "name": {"type": "string"},
                        "verdict": {"enum": ["accepted", "rejected", "skipped"]},
                        "chosen": {"type": "boolean"},
                        "reason": {"type": "string"},
                        "origin": {"type": "string"},
                        "coretype": text,
                        "decode_ms": number,
                        "prefill_ms": number,
                        "threads": {"type": ["integer", "null"]},
                        "threads_honoured": {"type": ["boolean", "null"]},
                        "config": text,
                        "corename": text,
                        "seconds": number,
                    },
                },
            },
            "paths": {
                "type": "object",
                "properties": {
                    "library": text,
                    "candidates": {"type": "object", "additionalProperties": text},
                },
            },
        },
    }


def _model() -> Schema:
    return {
        "type": "object",
        "required": ["id", "object", "created", "owned_by"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "model"},
            "created": {"type": "integer"},
            "owned_by": {"type": "string"},
            "format": {"type": "string"},
            "path": {
                "type": ["string", "null"],
                "description": "Its folder on the host; null for a paired client.",
            },
            "size_bytes": {"type": "integer", "minimum": 0},
            "digest": {
                "type": ["string", "null"],
                "description": "`sha256:` over its files' digests.",
            },
            "files": {
                "type": ["array", "null"],
                "description": "Its files (relative paths); null for a paired client.",
                "items": {
                    "type": "object",
                    "required": ["path", "size", "sha256"],
                    "properties": {
                        "path": {"type": "string"},
                        "size": {"type": "integer", "minimum": 0},
                        "sha256": {"type": "string"},
                    },
                },
            },
            "state": {"enum": ["available", "loaded", "missing", "corrupt"]},
            "source": {
                "type": ["string", "null"],
                "description": "A Hugging Face repo id, or the path registered from (null "
                "for a paired client).",
            },
        },
    }


def _input_item() -> Schema:
    return {
        "type": "object",
        "required": ["id", "type", "role", "content"],
        "properties": {
            "id": {"type": "string"},
            "type": {"const": "message"},
            "role": {"enum": ROLES},
            "status": {"type": "string"},
            "content": {"type": "array", "items": {"type": "object", "required": ["type", "text"]}},
        },
    }


def _response_deleted() -> Schema:
    return {
        "type": "object",
        "required": ["id", "object", "deleted"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "response.deleted"},
            "deleted": {"const": True},
        },
    }


def _create_response_request() -> Schema:
    text_part = {
        "type": "object",
        "required": ["type", "text"],
        "properties": {
            "type": {"enum": ["input_text", "output_text", "text"]},
            "text": {"type": "string"},
        },
    }
    message = {
        "type": "object",
        "required": ["role", "content"],
        "properties": {
            "type": {"const": "message"},
            "role": {"enum": ROLES, "description": "`developer` is treated as `system`."},
            "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": text_part}]},
        },
    }
    properties: dict[str, Any] = {
        "model": {
            "type": ["string", "null"],
            "description": "A model id; the default model when absent.",
        },
        "input": {
            "anyOf": [{"type": "string"}, {"type": "array", "minItems": 1, "items": message}],
            "description": "A string (one user message) or a list of messages with text content.",
        },
        "instructions": {
            "type": ["string", "null"],
            "description": "A system message before `input`.",
        },
        "max_output_tokens": {"type": ["integer", "null"], "minimum": 1},
        "temperature": {
            "type": ["number", "null"],
            "minimum": 0,
            "maximum": 2,
            "description": "0 is greedy decoding.",
        },
        "top_p": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 1},
        "stream": {
            "type": ["boolean", "null"],
            "description": "Answer `200 text/event-stream` with the task's events.",
        },
        "background": {
            "type": ["boolean", "null"],
            "description": "Answer `202` at once with the queued response (requires `store`).",
        },
        "store": {
            "type": ["boolean", "null"],
            "description": "Defaults to true; must be true with `background`.",
        },
        "previous_response_id": {
            "type": ["string", "null"],
            "description": "Continue the conversation of a finished response.",
        },
        "metadata": _nullable(_metadata_schema()),
        "seed": {
            "type": ["integer", "null"],
            "minimum": 0,
            "maximum": 2**63 - 1,
            "description": "LMSP: sampling seed; a random one is chosen (and shown) when absent.",
        },
        "on_restart": {
            "enum": [*(p.value for p in RestartPolicy), None],
            "description": "LMSP: what happens to the task if the service restarts "
            "(default `resume` for background, `fail` otherwise).",
        },
    }
    for name, allowed in HARMLESS_DEFAULTS.items():
        properties.setdefault(name, _harmless(allowed))
    return {
        "type": "object",
        "required": ["input"],
        "additionalProperties": False,
        "properties": properties,
        # A background response must be stored: it could not be retrieved otherwise.
        "if": {"required": ["background"], "properties": {"background": {"const": True}}},
        "then": {"properties": {"store": {"enum": [True, None]}}},
        "description": "Unknown fields are refused (`unknown_parameter`), and so are fields the "
        "service cannot honour (`unsupported_parameter`).",
    }


def _create_chat_request() -> Schema:
    empty = {"anyOf": [{"type": "null"}, {"type": "array", "maxItems": 0}]}
    message: Schema = {
        "type": "object",
        "required": ["role", "content"],
        "additionalProperties": False,
        "properties": {
            "role": {
                "enum": ["system", "developer", "user", "assistant"],
                "description": "`developer` is treated as `system`.",
            },
            "content": {
                "anyOf": [
                    {"type": "string"},
                    {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "required": ["type", "text"],
                            "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
                        },
                    },
                ]
            },
            "name": {"type": ["string", "null"]},
            **{name: empty for name in sorted(NEUTRAL_MESSAGE_FIELDS)},
        },
    }
    string_or_null = {"type": ["string", "null"]}
    properties: dict[str, Any] = {
        "model": {
            "type": ["string", "null"],
            "description": "A model id; the default model when absent.",
        },
        "messages": {"type": "array", "minItems": 1, "items": message},
        "max_tokens": {
            "type": ["integer", "null"],
            "minimum": 1,
            "description": "Same as `max_completion_tokens`.",
        },
        "max_completion_tokens": {"type": ["integer", "null"], "minimum": 1},
        "temperature": {"type": ["number", "null"], "minimum": 0, "maximum": 2},
        "top_p": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 1},
        "seed": {"type": ["integer", "null"], "minimum": 0, "maximum": 2**63 - 1},
        "stream": {"type": ["boolean", "null"]},
        "stream_options": _nullable(
            {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    "include_usage": {"type": ["boolean", "null"]},
                    "include_obfuscation": {"enum": [False, None]},
                },
                "description": "Only with `stream: true`.",
            }
        ),
        "n": {"anyOf": [{"const": 1}, {"type": "null"}], "description": "One choice only."},
        "stop": {**empty, "description": "Stop sequences are not supported."},
        "metadata": _nullable(_metadata_schema()),
        "store": {
            "enum": [False, None],
            "description": "Stored chat completions are not supported.",
        },
        "user": string_or_null,
        "safety_identifier": string_or_null,
        "prompt_cache_key": string_or_null,
    }
    for name, allowed in NEUTRAL_VALUES.items():
        properties.setdefault(name, _neutral(allowed))
    return {
        "type": "object",
        "required": ["messages"],
        "additionalProperties": False,
        "properties": properties,
        # `stream_options` (not null) only with `stream: true`.
        "if": {
            "required": ["stream_options"],
            "properties": {"stream_options": {"type": "object"}},
        },
        "then": {"required": ["stream"], "properties": {"stream": {"const": True}}},
        "description": "A chat completion runs as a response task (restart policy `fail`). "
        "`max_tokens` and `max_completion_tokens` must agree when both are given.",
    }


def _chat_envelope(object_: str) -> dict[str, Any]:
    return {
        "id": {"type": "string", "pattern": "^chatcmpl-"},
        "object": {"const": object_},
        "created": {"type": "integer"},
        "model": {"type": "string"},
        "system_fingerprint": {"type": ["string", "null"]},
        "response_id": {
            "type": "string",
            "description": "LMSP: the response that holds this completion.",
        },
        "task_id": {"type": "string", "description": "LMSP: the task that generated it."},
        "seed": {"type": ["integer", "null"]},
    }


def _chat_usage() -> Schema:
    return {
        "type": "object",
        "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
        "properties": {
            "prompt_tokens": {"type": "integer", "minimum": 0},
            "completion_tokens": {"type": "integer", "minimum": 0},
            "total_tokens": {"type": "integer", "minimum": 0},
        },
    }


def _chat_completion() -> Schema:
    return {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            **_chat_envelope("chat.completion"),
            "choices": {
                "type": "array",
                "minItems": 1,
                "maxItems": 1,
                "items": {
                    "type": "object",
                    "required": ["index", "message", "finish_reason"],
                    "properties": {
                        "index": {"const": 0},
                        "message": {
                            "type": "object",
                            "required": ["role", "content"],
                            "properties": {
                                "role": {"const": "assistant"},
                                "content": {"type": "string"},
                            },
                        },
                        "finish_reason": {"enum": ["stop", "length"]},
                    },
                },
            },
            "usage": _ref("ChatUsage"),
        },
    }


def _chat_chunk() -> Schema:
    return {
        "type": "object",
        "description": "One `data:` line of a chat stream (which ends with `data: [DONE]`).",
        "required": ["id", "object", "created", "model", "choices"],
        "properties": {
            **_chat_envelope("chat.completion.chunk"),
            "choices": {
                "type": "array",
                "maxItems": 1,
                "items": {
                    "type": "object",
                    "required": ["index", "delta", "finish_reason"],
                    "properties": {
                        "index": {"const": 0},
                        "delta": {
                            "type": "object",
                            "properties": {
                                "role": {"const": "assistant"},
                                "content": {"type": "string"},
                            },
                        },
                        "finish_reason": {"enum": ["stop", "length", None]},
                    },
                },
            },
            "usage": _nullable(_ref("ChatUsage")),
        },
    }


def _scopes(min_items: int = 0) -> Schema:
    return {"type": "array", "minItems": min_items, "items": {"enum": list(SCOPES)}}


def _start_pairing_request() -> Schema:
    return {
        "type": "object",
        "required": ["client_name", "scopes"],
        "additionalProperties": False,
        "properties": {
            "client_name": {
                "type": "string",
                "minLength": 1,
                "maxLength": 100,
                "pattern": "\\S",
                "description": "Shown to the owner when they approve or deny the pairing.",
            },
            "scopes": {**_scopes(1), "description": "The scopes the client asks for."},
        },
    }


def _pairing_started() -> Schema:
    return {
        "type": "object",
        "description": "RFC 8628's device authorization response: the client keeps "
        "`device_code` secret and shows `user_code` to the owner.",
        "required": [
            "id",
            "object",
            "device_code",
            "user_code",
            "expires_at",
            "interval",
            "scopes",
        ],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "pairing"},
            "device_code": {"type": "string"},
            "user_code": {"type": "string", "examples": ["WDJB-MJHT"]},
            "expires_at": {"type": "integer"},
            "interval": {"type": "integer", "minimum": 1, "description": "Seconds between polls."},
            "scopes": _scopes(1),
        },
    }


def _pairing() -> Schema:
    return {
        "type": "object",
        "description": "A pairing as the owner sees it (never its device code).",
        "required": ["id", "object", "client_name", "requested_scopes", "user_code", "status"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "pairing"},
            "client_name": {"type": "string"},
            "requested_scopes": _scopes(),
            "granted_scopes": _nullable(_scopes()),
            "user_code": {"type": "string"},
            "status": {"type": "string", "examples": ["pending", "approved", "denied"]},
            "client_id": {"type": ["string", "null"]},
            "created_at": {"type": "integer"},
            "expires_at": {"type": "integer"},
        },
    }


def _pairing_decision() -> Schema:
    return {
        "type": "object",
        "properties": {
            "scopes": {
                **_scopes(),
                "description": "Approve only these (a subset of the requested scopes).",
            }
        },
    }


def _pairing_token_request() -> Schema:
    return {
        "type": "object",
        "required": ["device_code"],
        "properties": {"device_code": {"type": "string", "minLength": 1}},
    }


def _pairing_token() -> Schema:
    return {
        "type": "object",
        "description": "Issued exactly once, after the owner approved the pairing.",
        "required": ["object", "client_id", "access_token", "token_type", "scopes"],
        "properties": {
            "object": {"const": "pairing.token"},
            "client_id": {"type": "string"},
            "access_token": {"type": "string"},
            "token_type": {"const": "Bearer"},
            "scopes": _scopes(),
        },
    }


def _client() -> Schema:
    return {
        "type": "object",
        "description": "A paired client (never its token).",
        "required": ["id", "object", "name", "scopes", "created_at"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "client"},
            "name": {"type": "string"},
            "scopes": _scopes(),
            "created_at": {"type": "integer"},
            "last_used_at": {"type": ["integer", "null"]},
            "revoked_at": {"type": ["integer", "null"]},
        },
    }


def _register_model_request() -> Schema:
    return {
        "type": "object",
        "required": ["source"],
        "additionalProperties": False,
        "properties": {
            "source": {
                "type": "string",
                "pattern": "\\S",
                "description": "A local MLX model directory, a Hugging Face repo id found in "
                "the local cache, or a GGUF file (converted into the model store).",
            },
            "id": {
                "type": ["string", "null"],
                "pattern": "^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$",
                "description": "The model's id (derived from the source when absent).",
            },
        },
    }


def _model_deleted() -> Schema:
    return {
        "type": "object",
        "required": ["id", "object", "deleted"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "model"},
            "deleted": {"const": True},
        },
    }


def _event_stream_item() -> Schema:
    return {
        "type": "object",
        "description": "One server-sent event of a task's log: `id` is its sequence number, "
        "`event` its type, `data` the Event as JSON. Keep-alives are `:` comment lines.",
        "required": ["data"],
        "properties": {
            "id": {"type": "string", "pattern": "^[0-9]+$"},
            "event": {"type": "string"},
            "data": {
                "type": "string",
                "contentMediaType": JSON,
                "contentSchema": _ref("Event"),
            },
        },
    }


def _chat_stream_item() -> Schema:
    return {
        "type": "object",
        "description": "One `data:` line of a chat stream: a ChatCompletionChunk, an Error if "
        "the task failed or was cancelled after the stream began, or `[DONE]` last.",
        "required": ["data"],
        "properties": {
            "data": {
                "anyOf": [
                    {"const": "[DONE]"},
                    {
                        "type": "string",
                        "contentMediaType": JSON,
                        "contentSchema": {"anyOf": [_ref("ChatCompletionChunk"), _ref("Error")]},
                    },
                ]
            }
        },
    }


SCHEMAS = {
    "Error": _error,
    "Service": _service,
    "Model": _model,
    "ModelList": lambda: _list_of("Model", cursor=False),
    "RegisterModelRequest": _register_model_request,
    "ModelDeleted": _model_deleted,
    "Usage": _usage,
    "OutputText": _output_text,
    "OutputMessage": _output_message,
    "Response": _response,
    "ResponseDeleted": _response_deleted,
    "InputItem": _input_item,
    "InputItemList": lambda: _list_of("InputItem"),
    "Task": _task,
    "TaskList": lambda: _list_of("Task"),
    "Event": _event,
    "EventPage": _event_page,
    "EventStreamItem": _event_stream_item,
    "CreateResponseRequest": _create_response_request,
    "CreateChatCompletionRequest": _create_chat_request,
    "ChatUsage": _chat_usage,
    "ChatCompletion": _chat_completion,
    "ChatCompletionChunk": _chat_chunk,
    "ChatStreamItem": _chat_stream_item,
    "StartPairingRequest": _start_pairing_request,
    "PairingStarted": _pairing_started,
    "Pairing": _pairing,
    "PairingList": lambda: _list_of("Pairing", cursor=False),
    "PairingDecisionRequest": _pairing_decision,
    "PairingTokenRequest": _pairing_token_request,
    "PairingToken": _pairing_token,
    "Client": _client,
    "ClientList": lambda: _list_of("Client", cursor=False),
}


# ---------------------------------------------------------------------------------------------
# operations


def _op(
    op_id: str,
    summary: str,
    tag: str,
    responses: dict[str, Any],
    *,
    parameters: list[Schema] | None = None,
    body: str | None = None,
    body_required: bool = True,
    errors: tuple[int, ...] = AUTHED,
    public: bool = False,
) -> dict[str, Any]:
    op: dict[str, Any] = {"operationId": op_id, "summary": summary, "tags": [tag]}
    if parameters:
        op["parameters"] = parameters
    if body:
        op["requestBody"] = {"required": body_required, "content": _json_content(_ref(body))}
    op["responses"] = {**responses, **_errors(*sorted(set(errors)))}
    if public:
        op["security"] = []
    elif op_id in OPERATION_SCOPES:
        # The owner (Jupyter's token or cookie) holds every scope; a paired client's bearer
        # token needs this one.
        scope = OPERATION_SCOPES[op_id]
        op["security"] = [{"jupyterToken": []}, {"bearer": [scope]}]
        op["description"] = f"Requires the `{scope}` scope."
    return op


def _ok(
    description: str, schema: str, *, sse: str | None = None, status: str = "200"
) -> dict[str, Any]:
    content = _json_content(_ref(schema))
    if sse:
        content |= _sse_content(sse)
    return {status: {"description": description, "content": content}}


def _paths() -> dict[str, Any]:
    response_id = _path_id("response_id", "response")
    task_id = _path_id("task_id", "task")
    limit = lambda hi, default: _query(  # noqa: E731
        "limit", {"type": "integer", "minimum": 1, "maximum": hi, "default": default}, "Page size."
    )
    return {
        "/openapi.json": {
            "get": _op(
                "getOpenAPI",
                "This document",
                "service",
                {
                    "200": {
                        "description": "The OpenAPI 3.1 document.",
                        "content": _json_content({"type": "object"}),
                    }
                },
                errors=(),
                public=True,
            )
        },
        "/service": {
            "get": _op(
                "getService",
                "The service's identity, capabilities and limits",
                "service",
                _ok("The service.", "Service"),
            )
        },
        "/models": {
            "get": _op(
                "listModels",
                "The registered models",
                "models",
                _ok("The models.", "ModelList"),
            ),
            "post": _op(
                "registerModel",
                "Register a model (a task: files are hashed, GGUF is converted)",
                "models",
                {
                    "202": {
                        "description": "The registration task, committed before this answer; "
                        "its events are `task.*`.",
                        "headers": {
                            "Location": {
                                "description": "The task's URL.",
                                "required": True,
                                "schema": {"type": "string"},
                            }
                        },
                        "content": _json_content(_ref("Task")),
                    }
                },
                parameters=[_idempotency_header()],
                body="RegisterModelRequest",
                errors=(*POSTED, 404, 429),
            ),
        },
        "/models/{model_id}": {
            "get": _op(
                "getModel",
                "One model",
                "models",
                _ok("The model.", "Model"),
                parameters=[_path_id("model_id", "model")],
                errors=(*AUTHED, 404),
            ),
            "delete": _op(
                "deleteModel",
                "Forget a model (files the service made itself are removed)",
                "models",
                _ok("Deleted.", "ModelDeleted"),
                parameters=[_path_id("model_id", "model")],
                errors=(*AUTHED, 404),
            ),
        },
        "/responses": {
            "post": _op(
                "createResponse",
                "Create a response (plain, streamed, or in the background)",
                "responses",
                {
                    **_ok(
                        "The finished response, or with `stream: true` its task's events as "
                        "SSE (`id`, `event`, `data` lines; every `data` has `type` and "
                        "`sequence_number`).",
                        "Response",
                        sse="EventStreamItem",
                    ),
                    "202": {
                        "description": "With `background: true`: the queued response, committed "
                        "before this answer.",
                        "headers": {
                            "Location": {
                                "description": "The response's URL.",
                                "schema": {"type": "string"},
                            }
                        },
                        "content": _json_content(_ref("Response")),
                    },
                },
                parameters=[_idempotency_header()],
                body="CreateResponseRequest",
                errors=(*POSTED, 404, 429),
            )
        },
        "/responses/{response_id}": {
            "get": _op(
                "getResponse",
                "Retrieve a response, or stream its events",
                "responses",
                _ok(
                    "The response, or with `stream=true` its events as SSE.",
                    "Response",
                    sse="EventStreamItem",
                ),
                parameters=[
                    response_id,
                    _stream_flag(
                        "Stream the stored events, then the live ones, until the terminal event."
                    ),
                    _query(
                        "starting_after",
                        {"type": "integer"},
                        "With `stream`: only the events after this sequence number.",
                    ),
                ],
                errors=(400, *AUTHED, 404),
            ),
            "delete": _op(
                "deleteResponse",
                "Delete a finished response with its task and events",
                "responses",
                _ok("Deleted.", "ResponseDeleted"),
                parameters=[response_id],
                errors=(400, *AUTHED, 404),
            ),
        },
        "/responses/{response_id}/cancel": {
            "post": _op(
                "cancelResponse",
                "Cancel a response's task (a finished one is returned unchanged)",
                "responses",
                _ok("The response after the cancel request.", "Response"),
                parameters=[response_id, _idempotency_header()],
                errors=(*POSTED, 404),
            )
        },
        "/responses/{response_id}/input_items": {
            "get": _op(
                "listInputItems",
                "The input messages of a response",
                "responses",
                _ok("A page of input items.", "InputItemList"),
                parameters=[
                    response_id,
                    _query("after", {"type": "string"}, "The last item id of the previous page."),
                    limit(100, 20),
                    _query(
                        "order", {"enum": ["asc", "desc"], "default": "desc"}, "Order of the items."
                    ),
                ],
                errors=(400, *AUTHED, 404),
            )
        },
        "/tasks": {
            "get": _op(
                "listTasks",
                "Tasks, newest first",
                "tasks",
                _ok("A page of tasks.", "TaskList"),
                parameters=[
                    _query(
                        "state",
                        {"type": "array", "items": {"enum": [s.value for s in TaskState]}},
                        "Only tasks in these states (repeat the parameter, or separate with commas).",
                        style="form",
                        explode=True,
                        allowEmptyValue=True,
                    ),
                    _query(
                        "kind",
                        {"type": "string"},
                        "Only tasks of this kind (e.g. `response`).",
                        allowEmptyValue=True,
                    ),
                    _query(
                        "after",
                        {"type": "string"},
                        "The last task id of the previous page.",
                        allowEmptyValue=True,
                    ),
                    limit(100, 20),
                ],
                errors=(400, *AUTHED),
            )
        },
        "/tasks/{task_id}": {
            "get": _op(
                "getTask",
                "One task",
                "tasks",
                _ok("The task.", "Task"),
                parameters=[task_id],
                errors=(*AUTHED, 404),
            )
        },
        "/tasks/{task_id}/cancel": {
            "post": _op(
                "cancelTask",
                "Cancel a task: `queued` ends at once, `loading`/`running` go through `cancelling`",
                "tasks",
                _ok("The task after the cancel request (a finished one unchanged).", "Task"),
                parameters=[task_id, _idempotency_header()],
                errors=(*POSTED, 404),
            )
        },
        "/tasks/{task_id}/events": {
            "get": _op(
                "listTaskEvents",
                "A task's event log: a JSON page, or SSE (stored events, then live ones)",
                "tasks",
                _ok(
                    "A page of events; with `stream=true` (or `Accept: text/event-stream`) SSE "
                    "frames `id`, `event`, `data`, with `: keep-alive` comments while idle.",
                    "EventPage",
                    sse="EventStreamItem",
                ),
                parameters=[
                    task_id,
                    _query(
                        "after",
                        {"type": "integer", "default": -1},
                        "Events after this sequence number.",
                    ),
                    limit(1000, 100),
                    _stream_flag("Stream as SSE until the terminal event."),
                    _query(
                        "starting_after", {"type": "integer"}, "With `stream`: same as `after`."
                    ),
                    {
                        "name": "Last-Event-ID",
                        "in": "header",
                        "required": False,
                        "description": "An SSE reconnect: resume after this sequence number (wins over the query).",
                        "schema": {"type": "integer"},
                    },
                ],
                errors=(400, *AUTHED, 404),
            )
        },
        "/chat/completions": {
            "post": _op(
                "createChatCompletion",
                "Create a chat completion (the older OpenAI API), plain or streamed",
                "chat",
                _ok(
                    "The chat completion, or with `stream: true` an SSE stream of `data:` lines "
                    "(ChatCompletionChunk objects, `: keep-alive` comments, `data: [DONE]` last; "
                    "a failure after the first chunk arrives as a `data:` Error).",
                    "ChatCompletion",
                    sse="ChatStreamItem",
                ),
                parameters=[_idempotency_header()],
                body="CreateChatCompletionRequest",
                errors=(*POSTED, 404, 429, 500),
            )
        },
        "/pairings": {
            "post": _op(
                "startPairing",
                "Start pairing a client (no credentials): the device flow of RFC 8628",
                "pairing",
                _ok("The pairing, with the device and user codes.", "PairingStarted", status="201"),
                body="StartPairingRequest",
                errors=(400, 413, 429),
                public=True,
            ),
            "get": _op(
                "listPairings",
                "Pairings waiting for the owner's decision",
                "pairing",
                _ok("The pairings.", "PairingList"),
            ),
        },
        **{
            f"/pairings/{{pairing_id}}/{decision}": {
                "post": _op(
                    f"{decision}Pairing",
                    f"{decision.capitalize()} a pairing (by its id or its user code)",
                    "pairing",
                    _ok("The pairing as decided.", "Pairing"),
                    parameters=[
                        _path_id("pairing_id", "pairing (or its user code)"),
                        _idempotency_header(),
                    ],
                    body="PairingDecisionRequest" if decision == "approve" else None,
                    body_required=False,
                    errors=(*POSTED, 404),
                )
            }
            for decision in ("approve", "deny")
        },
        "/pairings/{pairing_id}/token": {
            "post": _op(
                "pollPairingToken",
                "Poll for the access token (no credentials)",
                "pairing",
                _ok("The access token, issued once.", "PairingToken"),
                parameters=[_path_id("pairing_id", "pairing")],
                body="PairingTokenRequest",
                errors=(400, 404, 413, 429),
                public=True,
            )
        },
        "/clients": {
            "get": _op(
                "listClients", "Paired clients", "pairing", _ok("The clients.", "ClientList")
            )
        },
        "/clients/{client_id}": {
            "delete": _op(
                "revokeClient",
                "Revoke a paired client's token",
                "pairing",
                _ok("The client, revoked.", "Client"),
                parameters=[_path_id("client_id", "client")],
                errors=(*AUTHED, 404),
            )
        },
    }


def openapi_document(server_url: str = "/lmsp/v1", version: str = "0") -> dict[str, Any]:
    """The whole document; `server_url` is where `lmsp/v1/` is mounted on this server."""
    return {
        "openapi": OPENAPI_VERSION,
        "jsonSchemaDialect": "https://json-schema.org/draft/2020-12/schema",
        "info": {
            "title": "LMSP 1.0 (jupyter-lmsp)",
            "version": version,
            "summary": "A local language-model service: OpenAI-Responses-shaped API, durable "
            "tasks with event logs, chat completions.",
        },
        "servers": [{"url": server_url}],
        "security": [{"jupyterToken": []}, {"bearer": []}],
        "tags": [
            {"name": "service"},
            {"name": "models"},
            {"name": "responses"},
            {"name": "tasks"},
            {"name": "chat"},
            {"name": "pairing"},
        ],
        "paths": _paths(),
        "components": {
            "schemas": {name: build() for name, build in SCHEMAS.items()},
            "responses": {
                name: {
                    "description": description,
                    "content": _json_content(_ref("Error")),
                    **({"headers": ERROR_HEADERS[status]} if status in ERROR_HEADERS else {}),
                }
                for status, (name, description) in ERRORS.items()
            },
            "parameters": {
                "IdempotencyKey": {
                    "name": "Idempotency-Key",
                    "in": "header",
                    "required": False,
                    "description": "Make this POST idempotent (LMSP B8): a repeat gets the first "
                    "result with `Idempotent-Replayed: true`.",
                    "schema": {
                        "type": "string",
                        "minLength": 1,
                        "maxLength": 255,
                        "pattern": "^[!-~]+$",
                    },
                }
            },
            "securitySchemes": {
                "jupyterToken": {
                    "type": "apiKey",
                    "in": "header",
                    "name": "Authorization",
                    "description": "Jupyter Server's own token: `Authorization: token <token>` "
                    "(the browser's cookie with the XSRF check works too).",
                },
                "bearer": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "`Authorization: Bearer <token>`: Jupyter's token, or a paired "
                    "client's access token.",
                },
            },
        },
    }
