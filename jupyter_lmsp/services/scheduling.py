"""Which of a runner's tasks runs next: its records, the fair queue, the slots, and which
generation to pause for a waiting owner.

`Slots` holds one `RunningTask` per task the runner holds (queued or with a slot) and knows
nothing of the engine or the database: the runner asks it what to claim (`to_claim`) and what
to pause (`to_pause`), and does that. Queued tasks wait in a `FairQueue`: their owners take
turns for the free slots, so one caller's backlog never holds another's new task back by more
than one turn. When every slot is taken and an owner holds more than its share while another
waits with less (`fairqueue.over_share`), one of its running generations is paused and queued
again (`push_paused`): it resumes from its snapshot (LMSP B7) when its turn comes.

Everything here runs on the runner's loop, except `holds`, which any thread may call (one
dictionary look-up).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from .fairqueue import FairQueue, Tier, over_share
from .running import RunningTask


class Slots:
    def __init__(self, max_active: int) -> None:
        self.max_active = max_active
        self.queue = FairQueue()
        self.tasks: dict[str, RunningTask] = {}
        # Those of `tasks` with a slot: a few, where `tasks` holds every queued task too
        # (thousands in a backlog), and every create asks how many slots are taken.
        self._held: dict[str, RunningTask] = {}
        # Called when a task takes a slot: the feed (`services.feed`) looks for other servers'
        # cancels often only while this runner holds a task.
        self.on_take: Callable[[], None] | None = None

    # -- records ----------------------------------------------------------------------------

    def get(self, task_id: str) -> RunningTask | None:
        return self.tasks.get(task_id)

    def holds(self, task_id: str) -> bool:
        """Whether the task has a slot here (being claimed, or running)."""
        return task_id in self._held

    def active(self) -> list[RunningTask]:
        return list(self._held.values())

    def active_count(self) -> int:
        return len(self._held)

    def forget(self, task_id: str) -> RunningTask | None:
        """The one place a task leaves the runner: its record, and its place in the queue."""
        self.queue.remove(task_id)
        self._held.pop(task_id, None)
        return self.tasks.pop(task_id, None)

    def stopped(self, task: RunningTask) -> None:
        """Its worker died: it gives its slot back, and nothing of its generation is left."""
        task.stopped()
        self._held.pop(task.task_id, None)

    def _record(
        self, task_id: str, owner: str, rows: int | None = None, tier: Tier | None = None
    ) -> RunningTask:
        task = self.tasks.get(task_id)
        if task is None:
            task = self.tasks[task_id] = RunningTask(task_id, owner)
        if rows is not None:
            task.rows = rows
        if tier is not None:
            task.tier = tier
        return task

    # -- the queue --------------------------------------------------------------------------

    def push(
        self, task_id: str, owner: str, rows: int | None = None, tier: Tier | None = None
    ) -> bool:
        """Queue a task without a slot at the end of its tier in its owner's line; whether it
        was."""
        task = self._record(task_id, owner, rows, tier)
        if task.has_slot:
            return False
        self.queue.push(task_id, owner, task.tier)
        return True

    def push_front(self, task_id: str, owner: str) -> bool:
        """Queue a task without a slot first (one that was running and must start again)."""
        task = self._record(task_id, owner)
        if task.has_slot:
            return False
        self.queue.push_front(task_id, owner, task.tier)
        return True

    def push_paused(self, task: RunningTask) -> None:
        """Queue a paused task again: first in its owner's line, after the waiting owners."""
        task.requeued()
        self._held.pop(task.task_id, None)
        self.queue.push_paused(task.task_id, task.owner, task.tier)

    def unqueue(self, task_id: str) -> bool:
        """Take a waiting task out of the queue (it ends); whether it was waiting."""
        task = self.tasks.get(task_id)
        return (task is None or not task.has_slot) and self.queue.remove(task_id)

    def clear_queue(self) -> None:
        """Forget every waiting task (they are another runner's now)."""
        for task_id in [t for t in self.tasks if t in self.queue]:
            self.forget(task_id)
        self.queue = FairQueue()

    # -- slots ------------------------------------------------------------------------------

    def used_rows(self) -> int:
        """The batch rows the running generations take; a cancelled one's are free already
        (the worker takes a job that comes while the row is still busy in its own queue)."""
        return sum(t.rows for t in self._held.values() if not t.cancelling)

    def to_claim(self) -> Iterator[RunningTask]:
        """The queued tasks to claim now, each given its slot as it is yielded (the slot is
        taken while the claim commits)."""
        while self.queue and self.used_rows() < self.max_active:
            task_id = self.queue.pop()
            task = self.tasks.get(task_id)
            if task is None or task.has_slot:
                continue
            if not self._fits(task.rows):
                self.queue.push_front(task_id, task.owner, task.tier)
                return
            self._take(task)
            yield task

    def _fits(self, rows: int) -> bool:
        """Whether a job of `rows` rows gets a slot now. A job takes all its rows at once; with
        nothing running it starts anyway (the worker takes a job wider than its batch when
        idle)."""
        used = self.used_rows()
        return used < self.max_active and not (used and used + rows > self.max_active)

    def _take(self, task: RunningTask) -> None:
        task.has_slot = True
        self._held[task.task_id] = task
        if self.on_take is not None:
            self.on_take()

    def reserve(self, task_id: str, owner: str, rows: int, tier: Tier) -> bool:
        """Give a task that is being created a slot now, if `to_claim` would give it one as
        soon as it was queued: nothing waits for a slot and its rows fit. Whether it did."""
        if self.queue or task_id in self.tasks or not self._fits(rows):
            return False
        self._take(self._record(task_id, owner, rows, tier))
        return True

    def to_pause(self) -> RunningTask | None:
        """The generation to pause, if any: of an owner holding more than its share of the
        slots while another owner waits with less; one pause at a time (the freed slot goes to
        the waiting owner, then the shares are looked at again). The latest started of that
        owner's running generations; none while its tasks are still loading (they could not
        resume from there)."""
        if not self.queue or self.used_rows() < self.max_active:
            return None
        active = self.active()
        waiting = self.queue.owners()
        if len(waiting) == 1 and all(t.owner == waiting[0] for t in active):
            # One owner in all: no share to restore (asked at every create of a backlog).
            return None
        if any(t.pausing for t in active):
            return None
        owner = over_share([t.owner for t in active if t.running], waiting, self.max_active)
        if owner is None:
            return None
        candidates = [t for t in active if t.owner == owner and t.running_since is not None]
        if not candidates:
            return None
        return max(candidates, key=lambda t: t.running_since or 0.0)

    def waiting(self) -> int:
        return len(self.queue)
