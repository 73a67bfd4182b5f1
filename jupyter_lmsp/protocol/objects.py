"""Wire objects built from stored rows: the response object (LMSP B5, B10) and the task object (B6).

These functions are the only place that decides what a response or a task looks like on the
wire; handlers, the event log and the store all call them.
"""

from __future__ import annotations

import json
from typing import Any

from ..store.tables import Client, Model, Pairing, Response, Task
from .states import TERMINAL_STATES, TaskState, response_status


def output_message(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [output_text_part(text)],
    }


def output_text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def usage_object(input_tokens: int, output_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input_tokens + output_tokens,
    }


def snapshot_of(task: Task) -> dict[str, Any]:
    """The task's generation snapshot (LMSP B7); an empty one before any token was produced."""
    if task.snapshot:
        return json.loads(task.snapshot)
    return {"output_index": 0, "item_id": None, "open": False, "token_ids": [], "text": ""}


def response_object(response: Response, task: Task) -> dict[str, Any]:
    """The response as the OpenAI Responses API shapes it, with its status from the task."""
    request = json.loads(response.request)
    state = TaskState(task.state)
    output = json.loads(response.output)
    if not output and state not in TERMINAL_STATES:
        snap = snapshot_of(task)
        if snap.get("open"):
            output = [output_message(snap["item_id"], snap["text"], "in_progress")]
    error = json.loads(response.error) if response.error else None
    return {
        "id": response.id,
        "object": "response",
        "created_at": int(response.created_at),
        "status": response_status(state, incomplete=response.incomplete_reason is not None),
        "background": bool(request.get("background", False)),
        "error": error,
        "incomplete_details": (
            {"reason": response.incomplete_reason} if response.incomplete_reason else None
        ),
        "instructions": request.get("instructions"),
        "max_output_tokens": request.get("max_output_tokens"),
        "model": response.model,
        "output": output,
        "parallel_tool_calls": False,
        "previous_response_id": response.previous_response_id,
        "temperature": request.get("temperature"),
        "top_p": request.get("top_p"),
        "tool_choice": "none",
        "tools": [],
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
        "usage": json.loads(response.usage) if response.usage else None,
        "metadata": request.get("metadata") or {},
        "store": response.store,
        "completed_at": int(response.completed_at) if response.completed_at else None,
        # LMSP fields
        "task_id": task.id,
        "seed": request.get("seed"),
        "on_restart": task.on_restart,
    }


def input_item(response_id: str, index: int, message: dict[str, str]) -> dict[str, Any]:
    """One message of a response's input, as `GET /responses/{id}/input_items` lists it."""
    role = message["role"]
    return {
        "id": f"msg_in_{response_id.split('_', 1)[1]}_{index}",
        "type": "message",
        "role": role,
        "status": "completed",
        # An assistant turn is listed as an output message (the openai SDK's
        # ResponseOutputMessage: its output_text part needs `annotations`).
        "content": [
            output_text_part(message["content"])
            if role == "assistant"
            else {"type": "input_text", "text": message["content"]}
        ],
    }


def task_object(task: Task) -> dict[str, Any]:
    return {
        "id": task.id,
        "object": "task",
        "kind": task.kind,
        "state": task.state,
        "on_restart": task.on_restart,
        "model": task.model,
        "response_id": task.response_id,
        "owner": task.owner,
        "error": json.loads(task.error) if task.error else None,
        "last_sequence_number": task.next_sequence - 1,
        "attempts": task.attempts,
        "created_at": task.created_at,
        "updated_at": task.updated_at,
        "finished_at": task.finished_at,
    }


def pairing_object(pairing: Pairing) -> dict[str, Any]:
    """A pairing request as the owner sees it (never the device code)."""
    return {
        "id": pairing.id,
        "object": "pairing",
        "client_name": pairing.client_name,
        "requested_scopes": json.loads(pairing.requested_scopes),
        "granted_scopes": json.loads(pairing.granted_scopes) if pairing.granted_scopes else None,
        "user_code": pairing.user_code,
        "status": pairing.status,
        "client_id": pairing.client_id,
        "created_at": int(pairing.created_at),
        "expires_at": int(pairing.expires_at),
    }


def client_object(client: Client) -> dict[str, Any]:
    """A paired client as the owner sees it (never its token or hash)."""
    return {
        "id": client.id,
        "object": "client",
        "name": client.name,
        "scopes": json.loads(client.scopes),
        "created_at": int(client.created_at),
        "last_used_at": int(client.last_used_at) if client.last_used_at else None,
        "revoked_at": int(client.revoked_at) if client.revoked_at else None,
    }


def model_object(
    model: Model, state: str | None = None, *, host_paths: bool = True
) -> dict[str, Any]:
    """A registered model in the OpenAI list shape, with LMSP's registry fields (B4).

    Without `host_paths` (what a paired client sees, docs/security.md) `path` and `files` are
    null, and `source` too unless it is a Hugging Face repo id: nothing about the host's
    folders. The owner sees everything."""
    return {
        "id": model.id,
        "object": "model",
        "created": int(model.created_at),
        "owned_by": model.owned_by,
        "format": model.format,
        "path": model.path if host_paths else None,
        "size_bytes": model.size_bytes,
        "digest": model.digest,
        "files": json.loads(model.files) if host_paths else None,
        "state": state or model.state,
        "source": model.source if host_paths or _is_repo_id(model.source) else None,
    }


def _is_repo_id(source: str) -> bool:
    # `org/name` as Hugging Face spells repo ids; a path source is stored absolute.
    parts = source.split("/")
    return len(parts) == 2 and all(parts) and not source.startswith((".", "~", "/"))
