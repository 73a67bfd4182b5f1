"""The runner's metrics (docs/metrics.md): each of its tasks' times as it moves through the
queue and the worker — queue wait, time to first token, inter-token latency, end-to-end
duration — and what the worker reports (tokens, batch sizes, the prompt cache, model loads),
recorded into `services.metrics`. The runner calls these on the loop; they are no-ops while
metrics are off (`metrics.set_enabled`)."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from ..protocol.states import TERMINAL_STATES
from .metrics import (
    ACCEPTED_DRAFT_TOKENS,
    ACTIVE,
    BATCH_SIZE,
    CACHE_BYTES,
    CACHE_HITS,
    CACHE_LOOKUPS,
    CACHE_REUSED_BYTES,
    CACHE_REUSED_TOKENS,
    E2E,
    INPUT_TOKENS,
    ITL,
    MODEL_LOAD_SECONDS,
    MODEL_LOADS,
    OUTPUT_TOKENS,
    QUEUE_DEPTH,
    QUEUE_WAIT,
    RESUMED_TOKENS,
    SNAPSHOT_LAG,
    TASKS_ENDED,
    TTFT,
    WORKER_RESTARTS,
    child,
    enabled,
)

_ENDS = frozenset(str(s) for s in TERMINAL_STATES)


@dataclass
class _Clock:
    """One task's times, as the runner sees them (monotonic seconds)."""

    queued: float
    submitted: float | None = None
    model: str = ""
    last_token: float | None = None
    first_token_seen: bool = False


class RunnerClock:
    """The runner's figures: it calls these on the loop as its tasks move."""

    def __init__(self) -> None:
        self._tasks: dict[str, _Clock] = {}

    def submitted(self, task_id: str) -> None:
        """A task this server created was committed `queued` and handed to the runner."""
        if enabled():
            now = time.monotonic()
            self._tasks[task_id] = _Clock(queued=now, submitted=now)

    def queued(self, task_id: str) -> None:
        """A task (adopted, paused, or back after a worker restart) waits for a slot again."""
        if not enabled():
            return
        now = time.monotonic()
        clock = self._tasks.get(task_id)
        if clock is None:
            self._tasks[task_id] = _Clock(queued=now)
        else:
            clock.queued = now
            clock.last_token = None

    def handed(self, task_id: str, model: str, resumed_tokens: int) -> None:
        """The task's job went to the worker."""
        if not enabled():
            return
        clock = self._tasks.setdefault(task_id, _Clock(queued=time.monotonic()))
        clock.model = model
        child(QUEUE_WAIT, model).observe(time.monotonic() - clock.queued)
        if resumed_tokens:
            child(RESUMED_TOKENS, model).inc(resumed_tokens)

    def started(
        self,
        task_id: str,
        input_tokens: int,
        cached_tokens: int,
        cache_bytes: int | None,
        load_seconds: float | None,
        reused_bytes: int = 0,
    ) -> None:
        if not enabled():
            return
        model = self._model(task_id)
        child(INPUT_TOKENS, model).inc(input_tokens)
        child(CACHE_LOOKUPS, model).inc()
        if cached_tokens:
            child(CACHE_HITS, model).inc()
            child(CACHE_REUSED_TOKENS, model).inc(cached_tokens)
        if reused_bytes:
            child(CACHE_REUSED_BYTES, model).inc(reused_bytes)
        if cache_bytes is not None:
            CACHE_BYTES.set(cache_bytes)
        if load_seconds is not None:
            child(MODEL_LOADS, model).inc()
            child(MODEL_LOAD_SECONDS, model).observe(load_seconds)

    def step(self, rows: Iterable[tuple[str, int]], batch_sizes: Iterable[int]) -> None:
        """The tokens of a step's rows (task id, tokens), counted together (issue 42: once per
        step, not per row): one clock read, each model's counter once, and each row's tokens
        in the inter-token histogram as before (one observation per token)."""
        if not enabled():
            return
        for size in batch_sizes:
            BATCH_SIZE.observe(size)
        now = time.monotonic()
        counted: dict[str, int] = {}
        for task_id, n in rows:
            if not n:
                continue
            clock = self._tasks.get(task_id)
            if clock is None:
                continue
            counted[clock.model] = counted.get(clock.model, 0) + n
            if not clock.first_token_seen:
                clock.first_token_seen = True
                if clock.submitted is not None:
                    child(TTFT, clock.model).observe(now - clock.submitted)
            elif clock.last_token is not None:
                gap = (now - clock.last_token) / n
                histogram = child(ITL, clock.model)
                for _ in range(n):
                    histogram.observe(gap)
            clock.last_token = now
        for model, n in counted.items():
            child(OUTPUT_TOKENS, model).inc(n)

    def accepted_drafts(self, task_id: str, n: int) -> None:
        """A generation finished; `n` of its tokens came from verified drafts."""
        if enabled() and n:
            child(ACCEPTED_DRAFT_TOKENS, self._model(task_id)).inc(n)

    def ended(self, task_id: str, model: str, state: str) -> None:
        """A transaction of the task committed: counted if it ended the task."""
        if not enabled() or state not in _ENDS:
            return
        clock = self._tasks.pop(task_id, None)
        child(TASKS_ENDED, model, state).inc()
        if clock is not None and clock.submitted is not None:
            child(E2E, model, state).observe(time.monotonic() - clock.submitted)

    def forget(self, task_id: str) -> None:
        self._tasks.pop(task_id, None)

    def _model(self, task_id: str) -> str:
        clock = self._tasks.get(task_id)
        return clock.model if clock is not None else ""

    @staticmethod
    def committed_snapshot(oldest: float) -> None:
        if enabled():
            SNAPSHOT_LAG.observe(time.monotonic() - oldest)

    @staticmethod
    def worker_restarted() -> None:
        if enabled():
            WORKER_RESTARTS.inc()

    @staticmethod
    def slots(queued: int, active: int) -> None:
        if enabled():
            QUEUE_DEPTH.set(queued)
            ACTIVE.set(active)
