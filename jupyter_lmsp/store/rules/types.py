"""The values the rules return and take, shared by their modules (no SQL here).

A rule returns what its transaction committed (`Committed`: the task, its response and the
events appended, numbered), so callers publish exactly that and nothing a later transaction
may have changed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.engine import Connection

from ...protocol.errors import LMSPError
from ...protocol.states import TaskState
from ..tables import Response, Task

Event = dict[str, Any]
EventBuilder = Callable[[Task, Response | None], list[Event]]

SERVER_RESTARTED = {
    "code": "server_restarted",
    "message": "The service restarted while this task was unfinished, and its policy is 'fail'.",
}
WORKER_CRASHED = {
    "code": "worker_crashed",
    "message": "The inference worker stopped while running this task, and its policy is 'fail'.",
}
CLIENT_REVOKED = {
    "code": "client_revoked",
    "message": "The client that created this task was revoked; its unfinished tasks are cancelled.",
}


@dataclass
class Committed:
    """What one transaction changed: the task as committed and the events it appended.

    From the hot paths (`append_outputs`, recovery) `task` and `response` are records with the
    table models' attributes rather than the models themselves (see `rows.record`): values to
    read, not rows to save.
    """

    task: Task
    response: Response | None
    events: list[Event] = field(default_factory=list)
    changed: bool = True
    # The runner that asked no longer holds the task: another runner adopted it (this one was
    # declared dead), or it ended. The caller stops driving it.
    lost: bool = False


@dataclass
class Outcome:
    """How a generation ended, as the runner reports it to `finish`."""

    state: TaskState
    error: dict[str, Any] | None = None
    incomplete_reason: str | None = None
    usage: dict[str, Any] | None = None
    # What a task that is not a response produced (a registered model), shown in its terminal
    # event; `also` writes it durably, on the transaction's connection, if the task ends as
    # reported.
    result: dict[str, Any] | None = None
    also: Callable[[Connection], None] | None = None


@dataclass
class RecoveryReport:
    examined: int = 0
    released_claims: int = 0
    transitions: dict[str, int] = field(default_factory=dict)
    committed: list[Committed] = field(default_factory=list)
    # The runners whose tasks were recovered (None: tasks no runner held), with why.
    runners: list[tuple[str | None, str]] = field(default_factory=list)
    # Unfinished tasks the recovering runner now holds (queued again, or `running` to resume),
    # and whose each of them is.
    adopted: list[str] = field(default_factory=list)
    owners: dict[str, str] = field(default_factory=dict)
    # The tasks examined by (state found, restart policy, state left in), for the metrics.
    by_policy: dict[tuple[str, str, str], int] = field(default_factory=dict)

    def add(self, other: RecoveryReport) -> None:
        self.examined += other.examined
        self.released_claims += other.released_claims
        for key, n in other.transitions.items():
            self.transitions[key] = self.transitions.get(key, 0) + n
        for key3, n in other.by_policy.items():
            self.by_policy[key3] = self.by_policy.get(key3, 0) + n
        self.committed.extend(other.committed)
        self.runners.extend(other.runners)
        self.adopted.extend(other.adopted)
        self.owners.update(other.owners)


def not_found(task_id: str) -> LMSPError:
    return LMSPError(
        404, "not_found", f"No task with id '{task_id}' found.", type="not_found_error"
    )


def not_held(task: Any, runner_id: str | None) -> bool:
    """Whether a runner that asks (`runner_id` given) does not hold `task` (LMSP B12)."""
    return runner_id is not None and task.runner_id != runner_id
