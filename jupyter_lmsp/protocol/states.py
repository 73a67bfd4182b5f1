"""Task states, restart policies, how a task's state shows as a response's status (LMSP B5, B6),
and which events of a task's log move it to which state.

`EVENT_STATES` is the one event -> state map: the store's lifecycle feed, the Python client, the
notebook widgets and (through the OpenAPI document's `*EventType` enums, which the sidebar's
generated TypeScript exports as values) the JupyterLab sidebar all read it; tests/
test_event_states.py fails if the TypeScript and this map drift apart. This module imports
nothing but the standard library, so the client can use it without the server's models.
"""

from __future__ import annotations

from enum import StrEnum


class TaskState(StrEnum):
    QUEUED = "queued"
    LOADING = "loading"
    RUNNING = "running"
    CANCELLING = "cancelling"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


class RestartPolicy(StrEnum):
    FAIL = "fail"
    RETRY = "retry"
    RESUME = "resume"


TERMINAL_STATES = frozenset({TaskState.COMPLETED, TaskState.FAILED, TaskState.CANCELLED})
UNFINISHED_STATES = frozenset(
    {TaskState.QUEUED, TaskState.LOADING, TaskState.RUNNING, TaskState.CANCELLING}
)

# Section 11.3, verbatim: the state a task left unfinished moves to at start-up, by policy.
RECOVERY_TABLE: dict[TaskState, dict[RestartPolicy, TaskState]] = {
    TaskState.QUEUED: {
        RestartPolicy.FAIL: TaskState.FAILED,
        RestartPolicy.RETRY: TaskState.QUEUED,
        RestartPolicy.RESUME: TaskState.QUEUED,
    },
    TaskState.LOADING: {
        RestartPolicy.FAIL: TaskState.FAILED,
        RestartPolicy.RETRY: TaskState.QUEUED,
        RestartPolicy.RESUME: TaskState.QUEUED,
    },
    TaskState.RUNNING: {
        RestartPolicy.FAIL: TaskState.FAILED,
        RestartPolicy.RETRY: TaskState.QUEUED,
        RestartPolicy.RESUME: TaskState.RUNNING,
    },
    TaskState.CANCELLING: {
        RestartPolicy.FAIL: TaskState.CANCELLED,
        RestartPolicy.RETRY: TaskState.CANCELLED,
        RestartPolicy.RESUME: TaskState.CANCELLED,
    },
}


# What each lifecycle event of a task's log moves the task to (docs/protocol.md, "Task states
# and events"); every other event (text, items, `task.progress`) is no transition. Responses'
# tasks use `response.*` lifecycle events, model registrations `task.*`.
EVENT_STATES: dict[str, TaskState] = {
    "response.created": TaskState.QUEUED,
    "response.queued": TaskState.QUEUED,
    "response.loading": TaskState.LOADING,
    "response.in_progress": TaskState.RUNNING,
    "response.cancelling": TaskState.CANCELLING,
    "response.completed": TaskState.COMPLETED,
    "response.incomplete": TaskState.COMPLETED,
    "response.failed": TaskState.FAILED,
    "response.cancelled": TaskState.CANCELLED,
    "task.created": TaskState.QUEUED,
    "task.queued": TaskState.QUEUED,
    "task.loading": TaskState.LOADING,
    "task.running": TaskState.RUNNING,
    "task.cancelling": TaskState.CANCELLING,
    "task.completed": TaskState.COMPLETED,
    "task.failed": TaskState.FAILED,
    "task.cancelled": TaskState.CANCELLED,
}

# The last event of a task's log: exactly one, and nothing follows it.
TERMINAL_EVENT_TYPES = frozenset(t for t, s in EVENT_STATES.items() if s in TERMINAL_STATES)


def state_after_event(event_type: str) -> TaskState | None:
    """The state `event_type` moves its task to, or None for an event that is no transition."""
    return EVENT_STATES.get(event_type)


def response_status(state: str, incomplete: bool = False) -> str:
    """The `status` a response shows for its task's state (LMSP B5)."""
    match TaskState(state):
        case TaskState.QUEUED | TaskState.LOADING:
            return "queued"
        case TaskState.RUNNING | TaskState.CANCELLING:
            return "in_progress"
        case TaskState.COMPLETED:
            return "incomplete" if incomplete else "completed"
        case TaskState.FAILED:
            return "failed"
        case TaskState.CANCELLED:
            return "cancelled"


# The statuses of a response whose task has ended.
TERMINAL_RESPONSE_STATUSES = frozenset(
    response_status(state, incomplete) for state in TERMINAL_STATES for incomplete in (False, True)
)
