"""A create that finds its runner with a free slot claims its task in its own transaction
(issue 42).

Without it, a new task is committed `queued`, handed to the runner, claimed in a second
transaction on the runner's database thread (`queued` → `loading`), and only then sent to
the engine: two commits and two turns of the loop before the worker hears of it, each
waiting behind whatever else the loop and the write lock were doing. Under a burst of
requests that was most of the service's time to first token on a fast model.

When the runner has a free slot and no task waits for one, the task would be claimed as soon
as it was queued anyway: `reserve` gives it that slot before its create (on the loop), the
create's transaction also claims it (`rules.claim_to_run`, a savepoint of the same
transaction, `Database.grouped`), and its job, built after that commit (`claiming.prepare`),
goes to the engine.
Its watchers see the same events in the same order (`response.created`, then
`response.loading`), committed together. A create that fails gives the slot back.

`TaskRunner` holds one (`runner.reservations`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..store import rules
from . import claiming
from .fairqueue import Tier

if TYPE_CHECKING:
    from .runner import TaskRunner


class Reservations:
    def __init__(self, runner: TaskRunner) -> None:
        self.runner = runner

    def reserve(self, task_id: str, owner: str, rows: int = 1, tier: Tier = Tier.DEFAULT) -> bool:
        """(loop) Give a task about to be created a free slot now, if it would get one as soon
        as it was queued (`Slots.reserve`). False: create it queued and `submit` it."""
        runner = self.runner
        if (
            not runner.started
            or not runner.executes
            or runner.engine is None
            or threading.current_thread() is not runner.loop_thread
            or not runner.slots.reserve(task_id, owner, rows, tier)
        ):
            return False
        runner.clock.submitted(task_id)
        # An idle worker gathering a burst waits for it (as for a task `submit` queues).
        runner.engine.announce(task_id)
        runner.clock.slots(runner.slots.waiting(), runner.slots.active_count())
        return True

    def create(self, task_id: str, create: Callable[[], rules.Committed]) -> rules.Committed:
        """(the create's database thread) Run the create of a reserved task and claim it, in
        one transaction; publish what it committed and hand its job to the engine. A create
        that raises changes nothing and gives the slot back."""
        runner = self.runner
        try:
            with runner.db.grouped():
                committed = create()
                claimed = rules.claim_to_run(runner.db, task_id, runner.runner_id)
        except BaseException:
            self.release(task_id)
            raise
        runner.publish(committed)
        # The job is built after the commit, the write lock free for the other writers.
        start = claiming.prepare(runner.db, runner.catalog, runner.runner_id, claimed, task_id)
        # After the publish above: the task's `response.loading` follows its `created`.
        runner.on_loop(self._begin, start)
        return committed

    def release(self, task_id: str) -> None:
        """(any thread) The reserved task's create failed, or never ran: its slot is free."""
        self.runner.on_loop(self._release, task_id)

    def _begin(self, start: claiming.Start) -> None:
        runner = self.runner
        task = runner.slots.get(start.task_id)
        if start.job is not None and (task is None or not task.has_slot):
            # The worker died between the reservation and the commit, and its recovery ran
            # before the task was written: the task gets that recovery now, as the tasks the
            # worker held did (otherwise it would stay `loading` with nothing running it).
            for committed in start.committed:
                runner.publish(committed)
            runner.dispatcher.recover([start.task_id])
            return
        runner.begin(start)

    def _release(self, task_id: str) -> None:
        self.runner.forget(task_id)
        self.runner.schedule()
