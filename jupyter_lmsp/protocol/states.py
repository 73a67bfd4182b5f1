"""Task states, restart policies and how a task's state shows as a response's status (LMSP B5, B6)."""

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
