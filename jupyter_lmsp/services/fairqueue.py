"""A queue of task ids that takes turns between their owners (docs/security.md).

Each owner (a paired client, the Jupyter user) has its own first-in-first-out line, and the
lines are served in turn: a task is taken from the line whose turn it is, and that owner goes
to the back. An owner with a thousand tasks queued therefore delays another owner's new task
by at most one task of each owner ahead of it in the turn order, never by its backlog.

Turns alone do not help a newcomer when one owner already holds every decoding slot with long
generations: `over_share` names the owner holding more than its fair share of the slots while
another owner waits with fewer, so the runner can pause one of its generations (it resumes
from its snapshot, LMSP B7) and give the slot away.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Iterable


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

    def push_paused(self, task_id: str, owner: str) -> None:
        """Queue a task whose generation was paused to free its slot: first in its owner's
        line, but its owner's turn comes after the owners already waiting."""
        if task_id in self._owner_of:
            return
        self._owner_of[task_id] = owner
        line = self._lines.get(owner)
        if line is None:
            line = self._lines[owner] = deque()
        line.appendleft(task_id)
        self._lines.move_to_end(owner)

    def remove(self, task_id: str) -> bool:
        """Take `task_id` out of the queue; whether it was there."""
        owner = self._owner_of.pop(task_id, None)
        if owner is None:
            return False
        line = self._lines[owner]
        line.remove(task_id)
        if not line:
            del self._lines[owner]
        return True

    def owners(self) -> list[str]:
        """The owners with queued tasks, in turn order."""
        return list(self._lines)

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


def over_share(running: Iterable[str], waiting: Iterable[str], slots: int) -> str | None:
    """The owner to take a slot from, if any: given the owners of the running tasks (one entry
    per task) and the owners with queued tasks, the one holding the most slots, above an equal
    share of `slots` among all these owners, while some waiting owner holds less than that
    share. None when the slots are shared fairly (or some are free)."""
    held = Counter(running)
    if sum(held.values()) < slots:
        return None
    owners = set(held) | set(waiting)
    share = max(1, slots // max(1, len(owners)))
    if not any(held.get(owner, 0) < share for owner in waiting):
        return None
    owner, count = max(held.items(), key=lambda item: (item[1], item[0]))
    return owner if count > share else None
