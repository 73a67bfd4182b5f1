"""A runner's output stage: the engine's tokens read into each task's pending batch, and the
pending batches committed together, with the snapshot that covers them (LMSP B7).

The inference worker is the one stage that coalesces tokens (`engine.worker`: it holds them
for the extension's `snapshot_interval`, a choice's first text not at all, and sends every
row it held in one message). Here what arrives is committed on the loop's next turn, every
running task's pending output in one transaction, with whatever else arrived in that turn.
The engine's rows are kept as they come (`OutputStage.receive`, a list append per row) and
assembled when they are committed, each choice's run of rows merged into one feed of its
parsers (issue 42: the assembly per commit, not per token); what watchers see is decided at
the commit either way. A crash loses at most the interval's uncommitted work, and a resumed
task continues from exactly what its watchers saw.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Iterable

from ..engine.messages import JobTokens
from ..protocol.output import Batch
from .assembly import OutputAssembler, ToolCallError
from .running import RunningTask

log = logging.getLogger(__name__)

# Called with the batches to commit (by task id) and when the oldest of their tokens came.
Commit = Callable[[dict[str, Batch], float], None]


def merged(rows: list[JobTokens]) -> list[JobTokens]:
    """The rows of one task as one row per choice (in the order the choices first came): its
    tokens, text and log-probabilities in order. A choice's parsers make the same pieces of
    one feed as of its parts (they read text split anywhere, as tokens split it)."""
    if len(rows) == 1:
        return rows
    by_choice: dict[int, JobTokens] = {}
    for row in rows:
        have = by_choice.get(row.choice)
        if have is None:
            by_choice[row.choice] = JobTokens(
                row.job_id,
                list(row.token_ids),
                row.text,
                choice=row.choice,
                logprobs=list(row.logprobs) if row.logprobs is not None else None,
            )
            continue
        have.token_ids += row.token_ids
        have.text += row.text
        if row.logprobs is not None:
            have.logprobs = (have.logprobs or []) + row.logprobs
    return list(by_choice.values())


def _tokens(row: JobTokens, assembler: OutputAssembler) -> Batch:
    return assembler.tokens(row)


def read_unread(task: RunningTask) -> bool | None:
    """Assemble the rows kept for `task` (`OutputStage.receive`) into its pending batch, as
    `read` does: True when output was added, None when it broke now."""
    output = task.output
    if output is None or not output.unread:
        return False
    rows, output.unread = output.unread, []
    added = False
    for row in merged(rows):
        got = read(task, functools.partial(_tokens, row))
        if got is None:
            return None
        added = added or got
    return added


def read(task: RunningTask, step: Callable[[OutputAssembler], Batch]) -> bool | None:
    """Add what `step` makes of the engine's output to the task's pending batch: True when
    added, False when there is nothing to add to (no output yet, or one that broke), None
    when the output broke now (a tool call the model wrote cannot be read: `output.broken`
    says why, and its generation must stop)."""
    output = task.output
    if output is None or output.assembler is None or output.broken is not None:
        return False
    try:
        output.pending.add(step(output.assembler))
    except ToolCallError as e:
        log.warning("task %s: unreadable tool call: %s", task.task_id, e)
        output.broken = {"code": "tool_call_invalid", "message": f"A tool call: {e}"}
        return None
    return True


class OutputStage:
    def __init__(self, commit: Commit, broke: Callable[[RunningTask], None]) -> None:
        self.commit = commit
        # Called (after the commit) for a task whose output broke as its rows were assembled
        # for a commit: its generation must stop.
        self.broke = broke
        self.loop: asyncio.AbstractEventLoop | None = None
        # One commit scheduled for all running tasks: their tokens are committed together.
        self._handle: asyncio.Handle | None = None
        self._tasks: Callable[[], Iterable[RunningTask]] = tuple

    def bind(
        self, loop: asyncio.AbstractEventLoop, tasks: Callable[[], Iterable[RunningTask]]
    ) -> None:
        self.loop = loop
        self._tasks = tasks

    def receive(self, task: RunningTask, row: JobTokens) -> None:
        """Keep an engine row of `task` for its next commit (assembled then)."""
        output = task.output
        if output is None or output.assembler is None or output.broken is not None:
            return
        if not output.pending and not output.unread:
            output.pending_since = time.monotonic()
        output.unread.append(row)
        self.added()

    def added(self) -> None:
        """Output was added to a task's pending batch: commit it on the loop's next turn, with
        whatever else arrives before then."""
        assert self.loop is not None
        if self._handle is None:
            self._handle = self.loop.call_soon(self.flush_all)

    def flush(self, tasks: Iterable[RunningTask]) -> None:
        """Commit the output held for these tasks, in one transaction."""
        batches: dict[str, Batch] = {}
        broken: list[RunningTask] = []
        oldest = float("inf")
        for task in tasks:
            output = task.output
            if output is None:
                continue
            if output.unread and read_unread(task) is None:
                broken.append(task)
            if output.pending:
                oldest = min(oldest, output.pending_since)
                batches[task.task_id] = output.take()
        if batches:
            self.commit(batches, oldest)
        for task in broken:
            self.broke(task)

    def flush_all(self) -> None:
        self._handle = None
        self.flush(list(self._tasks()))
