"""The rules of LMSP section 11.2 and the start-up recovery of 11.3, one transaction each.

Every public function here is one write transaction (`Database.writing()`: `BEGIN IMMEDIATE`
on SQLite; on PostgreSQL one that locks the rows it reads before changing them, `SELECT … FOR
UPDATE`), written as SQLAlchemy Core statements on its connection, and named after the rule it
keeps. Where each rule lives:

- persist a task before `202 Accepted` — `create_task` (`lifecycle`);
- event sequence numbers and task state in one transaction — `append_events`,
  `start_running`, `append_output` / `append_outputs` (`lifecycle`); every event is written by
  `events.write`, the one writer of `task_events`, with the task row that counts it;
- the cancellation transition is atomic (a cancelled task never completes, a finished task
  never changes again) — `request_cancel`, `finish` (`lifecycle`);
- revoking a client cancels its unfinished tasks in the same transaction — `revoke_client`
  (`lifecycle`);
- retention never deletes an unfinished task — `purge_expired`, `delete_finished_task`
  (`retention`);
- the start-up recovery table (11.3) — `recover_at_startup`, `recover_runner`,
  `recover_after_worker_exit` (`recovery`);
- the shared queue (a worker's recent prompt cache keys first, within a head start) and the
  claim of a task to run — `claim_tasks`, `claim_to_run` (`queue`).

Who drives a task (LMSP B12): an unfinished task names its runner (`tasks.runner_id`, set by
the transaction that creates or adopts it, cleared by the one that ends it). The functions a
runner calls to drive a task take its `runner_id` and change nothing in a task another runner
holds (the result says `lost`): a runner declared dead while it still ran can never write
over the runner that adopted its tasks. Anyone may cancel any task (`request_cancel`); the
runner holding it sees the `cancelling` state and stops the generation.

The functions return plain values (table models or records built from the rows, committed
event dicts: `types`), so callers publish exactly what was committed.
"""

from ...protocol.output import Attempt
from .lifecycle import (
    Revocation,
    append_events,
    append_output,
    append_outputs,
    create_task,
    finish,
    request_cancel,
    revoke_client,
    start_running,
)
from .queue import PREFER_HEAD_START, Claim, Claimed, claim_tasks, claim_to_run
from .recovery import recover_after_worker_exit, recover_at_startup, recover_runner
from .retention import PurgeReport, delete_finished_task, purge_expired
from .types import (
    CLIENT_REVOKED,
    SERVER_RESTARTED,
    WORKER_CRASHED,
    Committed,
    Event,
    EventBuilder,
    Outcome,
    RecoveryReport,
)

__all__ = [
    "CLIENT_REVOKED",
    "PREFER_HEAD_START",
    "SERVER_RESTARTED",
    "WORKER_CRASHED",
    "Attempt",
    "Claim",
    "Claimed",
    "Committed",
    "Event",
    "EventBuilder",
    "Outcome",
    "PurgeReport",
    "RecoveryReport",
    "Revocation",
    "append_events",
    "append_output",
    "append_outputs",
    "claim_tasks",
    "claim_to_run",
    "create_task",
    "delete_finished_task",
    "finish",
    "purge_expired",
    "recover_after_worker_exit",
    "recover_at_startup",
    "recover_runner",
    "request_cancel",
    "revoke_client",
    "start_running",
]
