"""Wire objects built from stored rows: the response object (LMSP B5, B10), the task (B6), and
the registry's, pairing's and client's objects.

These functions are the only place that decides what an object looks like on the wire;
handlers, the event log and the store all call them. They build through the models of this
package, so what they return is what the OpenAPI document says. A row is anything with the
attributes of its table (`ResponseRow`, …, read-only: a row may be more precise): the store's
SQLModel rows, or the plain records of its raw-SQL paths; the protocol does not depend on the
store.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

from .excerpt import output_tokens, prompt_excerpt
from .output import Attempt
from .pairing import Client, Pairing
from .registry import Model, ModelFile
from .response_object import (
    CustomToolCallOutputItem,
    FunctionCallOutputItem,
    InputCustomToolCallItem,
    InputFunctionCallItem,
    InputItem,
    InputText,
    InputTokensDetails,
    OutputText,
    OutputTokensDetails,
    Response,
    TaskError,
    Usage,
    output_message,
    output_text_part,
)
from .states import TERMINAL_STATES, TaskState, response_status
from .tasks import Task

__all__ = [
    "client_object",
    "input_item",
    "input_items",
    "model_object",
    "output_message",
    "output_text_part",
    "pairing_object",
    "response_object",
    "snapshot_of",
    "task_object",
    "usage_object",
    "with_namespace",
    "with_namespaces",
]


class ResponseSummaryRow(Protocol):
    """The columns of a response a task list reads (`task_object`)."""

    @property
    def request(self) -> str: ...

    @property
    def usage(self) -> str | None: ...

    @property
    def incomplete_reason(self) -> str | None: ...


class ResponseRow(ResponseSummaryRow, Protocol):
    @property
    def id(self) -> str: ...

    @property
    def output(self) -> str: ...

    @property
    def error(self) -> str | None: ...

    @property
    def model(self) -> str: ...

    @property
    def previous_response_id(self) -> str | None: ...

    @property
    def store(self) -> bool: ...

    @property
    def created_at(self) -> float: ...

    @property
    def completed_at(self) -> float | None: ...


class TaskRow(Protocol):
    @property
    def id(self) -> str: ...

    @property
    def kind(self) -> str: ...

    @property
    def state(self) -> str: ...

    @property
    def on_restart(self) -> str: ...

    @property
    def model(self) -> str | None: ...

    @property
    def response_id(self) -> str | None: ...

    @property
    def owner(self) -> str: ...

    @property
    def error(self) -> str | None: ...

    @property
    def next_sequence(self) -> int: ...

    @property
    def attempts(self) -> int: ...

    @property
    def created_at(self) -> float: ...

    @property
    def updated_at(self) -> float: ...

    @property
    def finished_at(self) -> float | None: ...

    @property
    def snapshot(self) -> str | None: ...

    @property
    def params(self) -> str: ...


class ModelRow(Protocol):
    @property
    def id(self) -> str: ...

    @property
    def created_at(self) -> float: ...

    @property
    def owned_by(self) -> str: ...

    @property
    def format(self) -> str: ...

    @property
    def path(self) -> str: ...

    @property
    def size_bytes(self) -> int: ...

    @property
    def digest(self) -> str | None: ...

    @property
    def files(self) -> str: ...

    @property
    def state(self) -> str: ...

    @property
    def source(self) -> str | None: ...


class PairingRow(Protocol):
    @property
    def id(self) -> str: ...

    @property
    def client_name(self) -> str: ...

    @property
    def requested_scopes(self) -> str: ...

    @property
    def granted_scopes(self) -> str | None: ...

    @property
    def user_code(self) -> str: ...

    @property
    def status(self) -> str: ...

    @property
    def client_id(self) -> str | None: ...

    @property
    def created_at(self) -> float: ...

    @property
    def expires_at(self) -> float: ...


class ClientRow(Protocol):
    @property
    def id(self) -> str: ...

    @property
    def name(self) -> str: ...

    @property
    def scopes(self) -> str: ...

    @property
    def created_at(self) -> float: ...

    @property
    def last_used_at(self) -> float | None: ...

    @property
    def revoked_at(self) -> float | None: ...


def usage_object(
    input_tokens: int,
    output_tokens: int,
    cached_tokens: int = 0,
    accepted_draft_tokens: int = 0,
    reasoning_tokens: int = 0,
) -> dict[str, Any]:
    return Usage(
        input_tokens=input_tokens,
        input_tokens_details=InputTokensDetails(cached_tokens=cached_tokens, cache_write_tokens=0),
        output_tokens=output_tokens,
        output_tokens_details=OutputTokensDetails(
            reasoning_tokens=reasoning_tokens, accepted_draft_tokens=accepted_draft_tokens
        ),
        total_tokens=input_tokens + output_tokens,
    ).wire()


def snapshot_of(task: TaskRow) -> dict[str, Any]:
    """The task's generation snapshot (LMSP B7); an empty one before any token was produced."""
    if task.snapshot:
        return dict(json.loads(task.snapshot))
    return {"output_index": 0, "item_id": None, "open": False, "token_ids": [], "text": ""}


def response_object(response: ResponseRow, task: TaskRow) -> dict[str, Any]:
    """The response as the OpenAI Responses API shapes it, with its status from the task."""
    request = json.loads(response.request)
    state = TaskState(task.state)
    output = json.loads(response.output)
    if not output and state not in TERMINAL_STATES:
        attempt = Attempt.load(task.snapshot)
        if attempt.open:
            output = attempt.output()
    tools = request.get("tools") or []
    namespaces = request.get("namespaces") or {}
    if namespaces:
        output = with_namespaces(output, namespaces)
    reasoning = request.get("reasoning") or {}
    return Response.model_validate(
        {
            "id": response.id,
            "created_at": int(response.created_at),
            "status": response_status(state, incomplete=response.incomplete_reason is not None),
            "background": bool(request.get("background", False)),
            "error": json.loads(response.error) if response.error else None,
            "incomplete_details": (
                {"reason": response.incomplete_reason} if response.incomplete_reason else None
            ),
            "instructions": request.get("instructions"),
            "max_output_tokens": request.get("max_output_tokens"),
            "model": response.model,
            "output": output,
            "parallel_tool_calls": request.get("parallel_tool_calls", True),
            "previous_response_id": response.previous_response_id,
            # Sampling as it ran: the defaults where the request gave none (rows of the first
            # releases stored null for them).
            "temperature": _number(request.get("temperature"), 1.0),
            "top_p": _number(request.get("top_p"), 1.0),
            "presence_penalty": _number(request.get("presence_penalty"), 0.0),
            "frequency_penalty": _number(request.get("frequency_penalty"), 0.0),
            "tool_choice": request.get("tool_choice") or ("auto" if tools else "none"),
            "tools": tools,
            "max_tool_calls": request.get("max_tool_calls"),
            "text": {
                "format": request.get("text_format") or {"type": "text"},
                "verbosity": request.get("verbosity") or "medium",
            },
            "top_logprobs": request.get("top_logprobs") or 0,
            "truncation": request.get("truncation") or "disabled",
            "reasoning": {
                "effort": reasoning.get("effort"),
                "summary": reasoning.get("summary"),
            },
            "usage": json.loads(response.usage) if response.usage else None,
            "metadata": request.get("metadata") or {},
            "store": response.store,
            # One queue serves every request (`auto` and `default` are all it accepts).
            "service_tier": request.get("service_tier") or "default",
            "safety_identifier": request.get("safety_identifier"),
            "prompt_cache_key": request.get("prompt_cache_key"),
            "user": request.get("user"),
            "completed_at": int(response.completed_at) if response.completed_at else None,
            "task_id": task.id,
            "seed": request.get("seed"),
            "on_restart": task.on_restart,
            "stop": request.get("stop"),
            "conversation": (
                {"id": conversation_id}
                if (conversation_id := getattr(response, "conversation_id", None))
                else None
            ),
            "truncation_details": request.get("truncation_details"),
        }
    ).wire()


def _number(value: Any, default: float) -> float:
    return default if value is None else float(value)


def with_namespaces(
    items: list[dict[str, Any]], namespaces: dict[str, str]
) -> list[dict[str, Any]]:
    """Output items with each call of a namespaced function naming its namespace (the log
    stores the function's own name: namespaces are flattened for the model)."""
    return [with_namespace(item, namespaces) for item in items]


def with_namespace(item: dict[str, Any], namespaces: dict[str, str]) -> dict[str, Any]:
    if item.get("type") in ("function_call", "custom_tool_call") and item.get("name") in namespaces:
        return {**item, "namespace": namespaces[item["name"]]}
    return item


def input_items(response_id: str, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages of a response's input as `GET /responses/{id}/input_items` lists them:
    an assistant turn's calls as `function_call` items after its text, tool results as
    `function_call_output` items."""
    base = response_id.split("_", 1)[1]
    items: list[dict[str, Any]] = []

    def next_id() -> str:
        return f"msg_in_{base}_{len(items)}"

    for message in messages:
        role = message["role"]
        if role == "tool":
            output_kind = (
                CustomToolCallOutputItem if message.get("custom") else FunctionCallOutputItem
            )
            items.append(
                output_kind(
                    id=next_id(),
                    call_id=message.get("tool_call_id") or "",
                    output=message.get("content") or "",
                    status="completed",
                ).wire()
            )
            continue
        calls = message.get("tool_calls") or []
        if message.get("content") or not calls:
            items.append(input_item(next_id(), message))
        for call in calls:
            if "input" in call:
                items.append(
                    InputCustomToolCallItem(
                        id=next_id(),
                        call_id=call["id"],
                        name=call["name"],
                        input=call["input"],
                        status="completed",
                    ).wire()
                )
                continue
            items.append(
                InputFunctionCallItem(
                    id=next_id(),
                    call_id=call["id"],
                    name=call["name"],
                    arguments=call["arguments"],
                    status="completed",
                ).wire()
            )
    return items


def input_item(item_id: str, message: dict[str, Any]) -> dict[str, Any]:
    """One message of a response's input."""
    role = message["role"]
    return InputItem(
        id=item_id,
        role=role,
        status="completed",
        # An assistant turn is listed as an output message (the openai SDK's
        # ResponseOutputMessage: its output_text part needs `annotations`).
        content=[
            OutputText(text=message["content"] or "")
            if role == "assistant"
            else InputText(text=message["content"] or "")
        ],
    ).wire()


def task_object(task: TaskRow, response: ResponseSummaryRow | None = None) -> dict[str, Any]:
    """The task object; with its response row, also what tells it apart in a list (its prompt's
    start, why it is incomplete, its output tokens)."""
    summary: dict[str, Any] = {}
    if response is not None:
        summary = {
            "prompt_excerpt": prompt_excerpt(response.request, task.params),
            "incomplete_reason": response.incomplete_reason,
            "output_tokens": output_tokens(response.usage),
        }
    return Task(
        id=task.id,
        kind=task.kind,
        state=task.state,
        on_restart=task.on_restart,
        model=task.model,
        response_id=task.response_id,
        owner=task.owner,
        error=TaskError(**json.loads(task.error)) if task.error else None,
        last_sequence_number=task.next_sequence - 1,
        attempts=task.attempts,
        created_at=task.created_at,
        updated_at=task.updated_at,
        finished_at=task.finished_at,
        **summary,
    ).wire()


def pairing_object(pairing: PairingRow) -> dict[str, Any]:
    """A pairing request as the owner sees it (never the device code)."""
    return Pairing(
        id=pairing.id,
        client_name=pairing.client_name,
        requested_scopes=json.loads(pairing.requested_scopes),
        granted_scopes=json.loads(pairing.granted_scopes) if pairing.granted_scopes else None,
        user_code=pairing.user_code,
        status=pairing.status,
        client_id=pairing.client_id,
        created_at=int(pairing.created_at),
        expires_at=int(pairing.expires_at),
    ).wire()


def client_object(client: ClientRow) -> dict[str, Any]:
    """A paired client as the owner sees it (never its token or hash)."""
    return Client(
        id=client.id,
        name=client.name,
        scopes=json.loads(client.scopes),
        created_at=int(client.created_at),
        last_used_at=int(client.last_used_at) if client.last_used_at else None,
        revoked_at=int(client.revoked_at) if client.revoked_at else None,
    ).wire()


def model_object(
    model: ModelRow,
    state: str | None = None,
    loaded_bytes: int | None = None,
    *,
    host_paths: bool = True,
) -> dict[str, Any]:
    """A registered model in the OpenAI list shape, with LMSP's registry fields (B4).

    Without `host_paths` (what a paired client sees, docs/security.md) `path` and `files` are
    null, and `source` too unless it is a Hugging Face repo id: nothing about the host's
    folders. The owner sees everything."""
    return Model(
        id=model.id,
        created=int(model.created_at),
        owned_by=model.owned_by,
        format=model.format,
        path=model.path if host_paths else None,
        size_bytes=model.size_bytes,
        digest=model.digest,
        files=[ModelFile(**f) for f in json.loads(model.files)] if host_paths else None,
        state=state or model.state,
        source=model.source if host_paths or _is_repo_id(model.source) else None,
        loaded_bytes=loaded_bytes,
    ).wire()


def _is_repo_id(source: str | None) -> bool:
    # `org/name` as Hugging Face spells repo ids; a path source is stored absolute.
    if not source:
        return False
    if source.startswith("hf://"):  # a download's `hf://ORG/NAME@COMMIT`
        source = source[len("hf://") :].split("@", 1)[0]
    parts = source.split("/")
    return len(parts) == 2 and all(parts) and not source.startswith((".", "~", "/"))
