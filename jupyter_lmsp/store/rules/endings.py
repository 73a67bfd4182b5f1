"""How a task ends: the events that close its open output and the one terminal event.

Shared by `finish`, the cancel of a queued task, the claim of a `cancelling` one and the 11.3
table: whichever rule ends a task, its log ends the same way (no SQL here; the caller numbers
and writes the events with `events.write`, and the response with `rows.save_responses`).
"""

from __future__ import annotations

import json
from typing import Any

from ...protocol import events as ev
from ...protocol.objects import response_object
from ...protocol.output import Attempt, LogprobLookup
from ...protocol.states import TaskState
from .types import Event, Outcome

_TERMINAL_EVENT = {
    TaskState.COMPLETED: ev.COMPLETED,
    TaskState.FAILED: ev.FAILED,
    TaskState.CANCELLED: ev.CANCELLED,
}


def close_open_item(task: Any, status: str, lookup: LogprobLookup | None = None) -> list[Event]:
    """The done events of the items still open, marking the attempt closed in the snapshot."""
    attempt = Attempt.load(task.snapshot)
    if not attempt.open:
        return []
    events = attempt.close(status, lookup)
    task.snapshot = attempt.dump()
    return events


def terminate(
    task: Any,
    response: Any | None,
    outcome: Outcome,
    now: float,
    lookup: LogprobLookup | None = None,
) -> list[Event]:
    """Move a task (and its response) to its terminal state; the events that say so, ending
    with exactly one terminal event, for the caller to number and write."""
    incomplete = outcome.state == TaskState.COMPLETED and outcome.incomplete_reason is not None
    item_status = (
        "completed" if outcome.state == TaskState.COMPLETED and not incomplete else "incomplete"
    )
    was_open = Attempt.load(task.snapshot).open
    events = close_open_item(task, item_status, lookup)
    task.state = outcome.state
    task.finished_at = now
    task.runner_id = None  # a finished task is nobody's to drive
    error = capped_error(outcome.error)
    if error is not None:
        task.error = json.dumps(error)
    if response is not None:
        if was_open:
            response.output = json.dumps(Attempt.load(task.snapshot).output(lookup))
        if outcome.usage is not None:
            response.usage = json.dumps(outcome.usage)
        if error is not None:
            response.error = json.dumps(error)
        response.incomplete_reason = outcome.incomplete_reason if incomplete else None
        response.completed_at = now
        kind = ev.INCOMPLETE if incomplete else _TERMINAL_EVENT[outcome.state]
        events.append(ev.lifecycle(kind, response_object(response, task)))
    else:
        events.append(
            {
                "type": f"task.{outcome.state}",
                "task_id": task.id,
                "error": error,
                "result": outcome.result,
            }
        )
    return events


# The longest error message stored (issue 43: a schema failing at run time once stored its
# whole 159 KB grammar in the message, in the task, the response and the terminal event).
MAX_ERROR_CHARS = 2048


def capped_error(error: dict[str, Any] | None) -> dict[str, Any] | None:
    """`error` with its message cut to `MAX_ERROR_CHARS` (marked where it was cut)."""
    if error is None:
        return None
    message = error.get("message")
    if not isinstance(message, str) or len(message) <= MAX_ERROR_CHARS:
        return error
    cut = len(message) - MAX_ERROR_CHARS
    return {**error, "message": message[:MAX_ERROR_CHARS] + f"... ({cut} more characters)"}
