"""A queue of task ids that takes turns between their owners (docs/security.md).

Each owner (a paired client, the Jupyter user) has its own first-in-first-out line, and the
lines are served in turn: a task is taken from the line whose turn it is, and that owner goes
to the back. An owner with a thousand tasks queued therefore delays another owner's new task
by at most one task of each owner ahead of it in the turn order, never by its backlog.

Within an owner's line, tasks wait by service tier (`Tier`: the request's `service_tier`):
`priority` before `default` before `flex`, in arrival order within a tier. A tier reorders only
its owner's own tasks, so no caller can pass another by asking for `priority`; and an owner
whose line holds only `flex` tasks lets every owner with other work go first (flex work runs
when nothing else waits).

Turns alone do not help a newcomer when one owner already holds every decoding slot with long
generations: `over_share` names the owner holding more than its fair share of the slots while
another owner waits with fewer, so the runner can pause one of its generations (it resumes
from its snapshot, LMSP B7) and give the slot away.
"""

from __future__ import annotations

import json
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable
from enum import IntEnum
from typing import Any


class Tier(IntEnum):
    """A queued task's service tier: lower is served first within its owner's line."""

    PRIORITY = 0
    DEFAULT = 1
    FLEX = 2

    @classmethod
    def of(cls, service_tier: str | None) -> Tier:
        """The tier of a request's `service_tier` (`auto`, `default` or none: `DEFAULT`)."""
        if service_tier == "priority":
            return cls.PRIORITY
        if service_tier == "flex":
            return cls.FLEX
        return cls.DEFAULT


def tier_of(task: Any) -> Tier:
    """The tier a task row asked for (its params' `service_tier`; rows without one, and tasks
    other than responses, are `DEFAULT`)."""
    try:
        params = json.loads(task.params or "{}")
    except ValueError:
        return Tier.DEFAULT
    return Tier.of(params.get("service_tier") if isinstance(params, dict) else None)


class _Line:
    """One owner's queued tasks: a first-in-first-out line per tier."""

    def __init__(self) -> None:
        self.tiers: tuple[deque[str], ...] = tuple(deque() for _ in Tier)

    def __bool__(self) -> bool:
        return any(self.tiers)

    @property
    def flex_only(self) -> bool:
        return not any(self.tiers[: Tier.FLEX])

    def pop(self) -> str:
        for tier in self.tiers:
            if tier:
                return tier.popleft()
        raise IndexError("pop from an empty line")

    def remove(self, task_id: str) -> None:
        for tier in self.tiers:
            if task_id in tier:
                tier.remove(task_id)
                return


class FairQueue:
    def __init__(self) -> None:
        # Owners with queued tasks, in turn order (the first is served next).
        self._lines: OrderedDict[str, _Line] = OrderedDict()
        self._owner_of: dict[str, str] = {}

    def __len__(self) -> int:
        return len(self._owner_of)

    def __bool__(self) -> bool:
        return bool(self._owner_of)

    def __contains__(self, task_id: object) -> bool:
        return task_id in self._owner_of

    def _line(self, task_id: str, owner: str) -> _Line | None:
        if task_id in self._owner_of:
            return None
        self._owner_of[task_id] = owner
        line = self._lines.get(owner)
        if line is None:
            line = self._lines[owner] = _Line()
        return line

    def push(self, task_id: str, owner: str, tier: Tier = Tier.DEFAULT) -> None:
        """Queue `task_id` at the end of its tier in its owner's line (an owner new to the
        queue takes its turn after the owners already waiting)."""
        line = self._line(task_id, owner)
        if line is not None:
            line.tiers[tier].append(task_id)

    def push_front(self, task_id: str, owner: str, tier: Tier = Tier.DEFAULT) -> None:
        """Queue `task_id` first in its tier of its owner's line, and its owner first in turn
        (a task that was already running and must be started again)."""
        line = self._line(task_id, owner)
        if line is not None:
            line.tiers[tier].appendleft(task_id)
            self._lines.move_to_end(owner, last=False)

    def push_paused(self, task_id: str, owner: str, tier: Tier = Tier.DEFAULT) -> None:
        """Queue a task whose generation was paused to free its slot: first in its tier of its
        owner's line, but its owner's turn comes after the owners already waiting."""
        line = self._line(task_id, owner)
        if line is not None:
            line.tiers[tier].appendleft(task_id)
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
        """The next task id, from the owner whose turn it is (passing over owners with only
        flex work while another has other work); that owner goes to the back."""
        owner, line = next(
            ((o, line) for o, line in self._lines.items() if not line.flex_only),
            next(iter(self._lines.items())),
        )
        task_id = line.pop()
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
