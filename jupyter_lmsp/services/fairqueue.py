"""A queue of task ids that takes turns between their owners (docs/security.md).

Each owner (a paired client, the Jupyter user) has its own first-in-first-out line, and the
lines are served in turn: a task is taken from the line whose turn it is, and that owner goes
to the back. An owner with a thousand tasks queued therefore delays another owner's new task
by at most one task of each owner ahead of it in the turn order, never by its backlog.
"""

from __future__ import annotations

from collections import OrderedDict, deque


class FairQueue:
    def __init__(self) -> None:
        # Owners with queued tasks, in turn order (the first is served next).
        self._lines: OrderedDict[str, deque[str]] = OrderedDict()
        self._owner_of: dict[str, str] = {}

    def __len__(self) -> int:
        return len(self._owner_of)

    def __bool__(self) -> bool:
        return bool(self._owner_of)

    def __contains__(self, task_id: object) -> bool:
        return task_id in self._owner_of

    def push(self, task_id: str, owner: str) -> None:
        """Queue `task_id` at the end of its owner's line (an owner new to the queue takes its
        turn after the owners already waiting)."""
        if task_id in self._owner_of:
            return
        self._owner_of[task_id] = owner
        line = self._lines.get(owner)
        if line is None:
            line = self._lines[owner] = deque()
        line.append(task_id)

    def push_front(self, task_id: str, owner: str) -> None:
        """Queue `task_id` first in its owner's line, and its owner first in turn (a task that
        was already running and must be started again)."""
        if task_id in self._owner_of:
            return
        self._owner_of[task_id] = owner
        line = self._lines.get(owner)
        if line is None:
            line = self._lines[owner] = deque()
        line.appendleft(task_id)
        self._lines.move_to_end(owner, last=False)

    def pop(self) -> str:
        """The next task id, from the owner whose turn it is; that owner goes to the back."""
        owner, line = next(iter(self._lines.items()))
        task_id = line.popleft()
        del self._owner_of[task_id]
        if line:
            self._lines.move_to_end(owner)
        else:
            del self._lines[owner]
        return task_id
