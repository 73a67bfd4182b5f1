"""The service's OpenAPI 3.1 document (LMSP B1), generated from the endpoints' operations and the
wire models, served at `GET /lmsp/v1/openapi.json`.

As FastAPI does (fastapi/openapi/utils.py): every model a body, a reply or a stream names is
turned into a JSON Schema (2020-12, OpenAPI 3.1's dialect) by pydantic in one pass, so shared
models become one `components/schemas` entry and refer to each other by `$ref`; query models
become parameters; each operation's access becomes its `security`. The document therefore
says exactly what the handlers enforce: there is nothing to keep in step by hand.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import GenerateJsonSchema, JsonSchemaMode, models_json_schema

from .errors import Error
from .fields import ID_PATTERN
from .operations import Endpoint, EventStream, Operation, Reply
from .states import EVENT_STATES, TERMINAL_EVENT_TYPES, TaskState

Schema = dict[str, Any]

OPENAPI_VERSION = "3.1.0"
REF = "#/components/schemas/{model}"
JSON = "application/json"
SSE = "text/event-stream"

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
        "A rate limit or a quota (queued tasks, tokens in flight, pending pairings) is "
        "reached (`Retry-After`).",
    ),
    500: ("ServerError", "The generation failed (chat completions only; never on bad input)."),
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

IDEMPOTENCY_KEY = {
    "name": "Idempotency-Key",
    "in": "header",
    "required": False,
    "description": "Make this POST idempotent (LMSP B8): a repeat gets the first result with "
    "`Idempotent-Replayed: true`.",
    "schema": {"type": "string", "minLength": 1, "maxLength": 255, "pattern": "^[!-~]+$"},
}

SECURITY_SCHEMES = {
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
}


class _Schemas(GenerateJsonSchema):
    """pydantic's generator, without a title on every property (the name says it)."""

    def field_title_should_be_set(self, schema: Any) -> bool:
        return False


def _ref(name: str) -> Schema:
    return {"$ref": REF.format(model=name)}


def openapi_document(
    endpoints: Sequence[Endpoint],
    server_url: str = "/lmsp/v1",
    version: str = "0",
    path_extensions: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """The whole document for `endpoints`; `server_url` is where `lmsp/v1/` is mounted;
    `path_extensions` adds `x-` members to path items (what is no operation: the WebSocket
    mode of `/responses`)."""
    inputs: list[tuple[type[BaseModel], JsonSchemaMode]] = [(Error, "serialization")]
    for endpoint in endpoints:
        inputs += _models_of(endpoint.operation)
    refs, defs = models_json_schema(
        list(dict.fromkeys(inputs)), ref_template=REF, schema_generator=_Schemas
    )
    schemas: dict[str, Schema] = dict(defs.get("$defs", {}))

    def ref(model: type[BaseModel], mode: JsonSchemaMode) -> Schema:
        return dict(refs[(model, mode)])

    def query_schema(model: type[BaseModel]) -> Schema:
        return schemas[ref(model, "validation")["$ref"].rsplit("/", 1)[1]]

    streams: dict[str, EventStream] = {}
    paths: dict[str, dict[str, Any]] = {}
    for endpoint in endpoints:
        op = endpoint.operation
        for reply in op.replies.values():
            if reply.stream is not None:
                streams[reply.stream.name] = reply.stream
        paths.setdefault(endpoint.path, {})[endpoint.method.lower()] = _operation(
            endpoint, ref, query_schema
        )
    for path, members in (path_extensions or {}).items():
        paths.setdefault(path, {}).update(members)
    # Query models became parameters; they are not schemas of their own.
    for endpoint in endpoints:
        if endpoint.operation.query is not None:
            schemas.pop(ref(endpoint.operation.query, "validation")["$ref"].rsplit("/", 1)[1], None)
    for stream in streams.values():
        schemas[stream.name] = _stream_item(stream, ref)
    schemas |= event_state_schemas()
    tags = list(dict.fromkeys(e.operation.tag for e in endpoints))
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
        "tags": [{"name": tag} for tag in tags],
        "paths": paths,
        "components": {
            "schemas": dict(sorted(schemas.items())),
            "responses": {
                name: {
                    "description": description,
                    "content": {JSON: {"schema": ref(Error, "serialization")}},
                    **({"headers": ERROR_HEADERS[status]} if status in ERROR_HEADERS else {}),
                }
                for status, (name, description) in ERRORS.items()
            },
            "parameters": {"IdempotencyKey": IDEMPOTENCY_KEY},
            "securitySchemes": SECURITY_SCHEMES,
        },
    }


def event_state_schemas() -> dict[str, Schema]:
    """The event -> task state map (`states.EVENT_STATES`) as enums: `QueuedEventType` are
    the event types that move a task to `queued`, and so on, and `TerminalEventType` those
    that end a log. As enums they become values in the sidebar's generated TypeScript
    (openapi-typescript `--enum-values`), which its `taskstate.ts` reads: one map, not a copy."""
    out: dict[str, Schema] = {}
    for state in TaskState:
        types = [t for t, s in EVENT_STATES.items() if s == state]
        out[f"{state.value.capitalize()}EventType"] = {
            "type": "string",
            "description": f"The event types that move a task to `{state.value}`.",
            "enum": types,
        }
    out["TerminalEventType"] = {
        "type": "string",
        "description": "The event types that end a task's log (exactly one, last).",
        "enum": [t for t in EVENT_STATES if t in TERMINAL_EVENT_TYPES],
    }
    return out


def _models_of(op: Operation) -> Iterable[tuple[type[BaseModel], JsonSchemaMode]]:
    if op.body is not None:
        yield op.body, "validation"
    if op.query is not None:
        yield op.query, "validation"
    for reply in op.replies.values():
        if reply.model is not None:
            yield reply.model, "serialization"
        if reply.stream is not None:
            for model in reply.stream.data:
                yield model, "serialization"


def _operation(endpoint: Endpoint, ref: Any, query_schema: Any) -> dict[str, Any]:
    op = endpoint.operation
    doc: dict[str, Any] = {"operationId": op.operation_id, "summary": op.summary, "tags": [op.tag]}
    parameters = [
        {
            "name": name,
            "in": "path",
            "required": True,
            "description": f"The {name.removesuffix('_id')}'s id.",
            "schema": {"type": "string", "pattern": ID_PATTERN},
        }
        for name in re.findall(r"\{(\w+)\}", endpoint.path)
    ]
    if op.query is not None:
        parameters += _query_parameters(query_schema(op.query))
    for header in op.headers:
        parameters.append(
            {
                "name": header.name,
                "in": "header",
                "required": False,
                "description": header.description,
                "schema": header.adapter.json_schema(),
            }
        )
    if op.idempotent:
        parameters.append({"$ref": "#/components/parameters/IdempotencyKey"})
    if parameters:
        doc["parameters"] = parameters
    if op.body is not None:
        doc["requestBody"] = {
            "required": op.body_required,
            "content": {JSON: {"schema": ref(op.body, "validation")}},
        }
    responses = {str(status): _reply(reply, ref) for status, reply in op.replies.items()}
    for status in op.error_statuses():
        responses[str(status)] = {"$ref": f"#/components/responses/{ERRORS[status][0]}"}
    doc["responses"] = responses
    if op.public:
        doc["security"] = []
    elif op.scope is not None:
        # The owner (Jupyter's token or cookie) holds every scope; a paired client's bearer
        # token needs this one.
        doc["security"] = [{"jupyterToken": []}, {"bearer": [op.scope]}]
        doc["description"] = f"Requires the `{op.scope}` scope."
    if op.description:
        doc["description"] = f"{doc.get('description', '')} {op.description}".strip()
    return doc


def _reply(reply: Reply, ref: Any) -> dict[str, Any]:
    content: dict[str, Any] = {}
    if reply.model is not None:
        content[JSON] = {"schema": ref(reply.model, "serialization")}
    elif reply.schema is not None:
        content[JSON] = {"schema": dict(reply.schema)}
    if reply.text is not None:
        content[reply.text] = {"schema": {"type": "string"}}
    if reply.stream is not None:
        # OpenAPI 3.1 has no standard way to describe a stream; `schema` describes each
        # event, read as an object of its fields (`id`, `event`, `data`), as OpenAPI 3.2's
        # `itemSchema` does and schemathesis expects.
        content[SSE] = {"schema": _ref(reply.stream.name)}
    out: dict[str, Any] = {"description": reply.description, "content": content}
    if reply.headers:
        out["headers"] = {
            name: {
                "description": header.description,
                **({"required": True} if header.required else {}),
                "schema": {"type": "string"},
            }
            for name, header in reply.headers.items()
        }
    return out


def _stream_item(stream: EventStream, ref: Any) -> Schema:
    members = [ref(model, "serialization") for model in stream.data]
    data: Schema = {
        "type": "string",
        "contentMediaType": JSON,
        "contentSchema": members[0] if len(members) == 1 else {"anyOf": members},
    }
    if stream.done is not None:
        data = {"anyOf": [{"const": stream.done}, data]}
    properties: dict[str, Any] = {"data": data}
    if stream.framed:
        properties = {
            "id": {"type": "string", "pattern": "^[0-9]+$"},
            "event": {"type": "string"},
            **properties,
        }
    return {
        "type": "object",
        "description": stream.description,
        "required": ["data"],
        "properties": properties,
    }


def _query_parameters(schema: Schema) -> list[dict[str, Any]]:
    required = set(schema.get("required", []))
    parameters = []
    for name, prop in schema["properties"].items():
        prop = dict(prop)
        description = prop.pop("description", "")
        parameter: dict[str, Any] = {
            "name": name,
            "in": "query",
            "required": name in required,
            "description": description,
            "schema": prop,
            # An empty value counts as absent (protocol.validation.validate_query).
            "allowEmptyValue": True,
        }
        if _is_array(prop):
            parameter |= {"style": "form", "explode": True}
        parameters.append(parameter)
    return parameters


def _is_array(schema: Schema) -> bool:
    if schema.get("type") == "array":
        return True
    return any(_is_array(s) for s in schema.get("anyOf", []))
