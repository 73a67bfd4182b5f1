"""What a task runner knows of one task it holds: a `RunningTask`, from when the task is queued
here until the runner forgets it (`services.scheduling.Slots.forget`, the one place).

A record is made when a task is queued (submitted, picked up from the database, adopted after
a worker's exit); it takes a slot when the runner claims it (`has_slot`), gets its `output`
when its job is handed to the engine, and is forgotten when the task ends here, is dropped to
another runner, or its worker died. A paused task keeps its record (its owner, its width, that
its text has begun) and goes back to the queue without its output.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..engine.messages import JobTokens
from ..protocol.output import Batch
from .assembly import OutputAssembler
from .fairqueue import Tier
from .generation import Generation


@dataclass
class TaskOutput:
    """A running task's output: how to read the engine's tokens, and what is not committed."""

    generation: Generation
    # The raw text each choice had when the job was (re)started, for the parsers (resume).
    resumed: list[str] = field(default_factory=list)
    # Made when the worker reports the job started (it names the tool-call format).
    assembler: OutputAssembler | None = None
    ended: set[int] = field(default_factory=set)
    # The engine's rows not yet assembled (`services.output`: read when they are committed),
    # then what they made, not yet committed.
    unread: list[JobTokens] = field(default_factory=list)
    pending: Batch = field(default_factory=Batch)
    # When the oldest of the pending tokens arrived (monotonic), for the snapshot commit lag.
    pending_since: float = field(default_factory=time.monotonic)
    # Why the task fails, once its output could not be read (a malformed tool call).
    broken: dict[str, str] | None = None

    def take(self) -> Batch:
        """The pending batch, leaving nothing pending."""
        batch, self.pending = self.pending, Batch()
        return batch


@dataclass
class RunningTask:
    task_id: str
    # Whose it is (the fair queue's turns, and pausing), as submitted, then as its row says.
    owner: str
    # The batch rows its job takes (a job with n choices takes n).
    rows: int = 1
    # Its service tier: where it waits in its owner's line (`fairqueue.Tier`).
    tier: Tier = Tier.DEFAULT
    # It holds a slot: being claimed, or handed to the engine.
    has_slot: bool = False
    # Set when its job is handed to the engine; dropped when it is paused.
    output: TaskOutput | None = None
    # The engine was told to cancel it (a cancel noticed twice is sent once; its rows count
    # as free).
    cancelling: bool = False
    # Being paused to free its slot for another owner.
    pausing: bool = False
    # The prompt tokens the worker found in its prompt cache (for the usage of a cancel).
    cached_tokens: int = 0
    # When its generation started (monotonic; the latest started is the one paused).
    running_since: float | None = None

    @property
    def running(self) -> bool:
        """Its job is in the engine (it may be paused, and resumes from there)."""
        return self.output is not None

    def requeued(self) -> None:
        """Back to waiting for a slot (paused): nothing of its generation is kept."""
        self.has_slot = False
        self.output = None
        self.pausing = False
        self.running_since = None

    def stopped(self) -> None:
        """Its worker died: nothing of its generation is left (a recovery may queue it
        again)."""
        self.requeued()
        self.cancelling = False
