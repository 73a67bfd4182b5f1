"""A thread that runs a task runner's transactions, in order, off the event loop.

A transaction can wait for the database's write lock — up to the busy timeout while another
server on the same file commits — and the event loop must never wait with it. So the runner
hands each of its transactions (claiming a task, committing generated text, ending a task,
recovering) to this one thread, which runs them in the order they were asked for and gives
each result back to the loop with `call_soon_threadsafe`, in the same order: events are
published after their commit, in commit order.

A job that finds the database locked past the busy timeout (another process held the write
lock for that long) is run again, after a pause, before any later job: each is one
transaction that either committed or changed nothing, and the order must hold. A job asked
with `retry_full` (a task's end) is run again the same way while the disk is full: the end of
a task must land, and it does as soon as there is room (issue 43); other jobs that fail give
their exception to their `on_error`, on the loop, which decides what it means for the task.

Given a `group` (the database's `grouped`, issue 42), the jobs waiting when the thread turns to
them run in one transaction: each rule a savepoint of it, one commit (one sync to disk) for all,
and their results handed to the loop together, in order, after that commit. A job that raises
changes nothing (its savepoint is rolled back) and gets its `on_error` as alone. A job that
finds the database locked or full stops the group there: what came before it commits, and it
runs alone, as above. Should the group's own begin or commit fail, nothing of it was written,
and its jobs run again one by one. Events are still published only after the commit that holds
them, in commit order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from ..store.errors import is_locked, is_storage_full
from . import metrics

__all__ = ["Committer", "is_locked", "is_storage_full"]

log = logging.getLogger(__name__)

_STOP = object()
# Pauses between attempts of a job that found the database locked, seconds.
RETRY_PAUSES = (0.05, 0.1, 0.2, 0.5, 1.0)
# The most jobs one group transaction takes (a long queue still commits in steps).
GROUP_LIMIT = 64

# A queued job: (fn, args, kwargs, then, future, on_error, retry_full).
Job = tuple[Any, ...]


class Committer:
    def __init__(
        self,
        name: str = "lmsp-db",
        group: Callable[[], AbstractContextManager[None]] | None = None,
    ) -> None:
        self.name = name
        # Opens one transaction for several jobs (`Database.grouped`); None: each job alone.
        self.group = group
        self.loop: asyncio.AbstractEventLoop | None = None
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._pending = 0
        self._idle = threading.Condition()

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()

    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        then: Callable[[Any], None] | None = None,
        on_error: Callable[[BaseException], None] | None = None,
        retry_full: bool = False,
        **kwargs: Any,
    ) -> None:
        """Run `fn(*args, **kwargs)` on the thread, after every job asked for before it; then
        `then(result)` on the event loop. An exception goes to `on_error` on the loop, or is
        logged without one (`then` is not called). With `retry_full`, a full disk makes the
        job wait and run again rather than fail."""
        with self._idle:
            self._pending += 1
        self._jobs.put((fn, args, kwargs, then, None, on_error, retry_full))

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> asyncio.Future[Any]:
        """Run `fn` on the thread, in order with the other jobs; a future of its result (or
        its exception) on the event loop."""
        assert self.loop is not None
        future: asyncio.Future[Any] = self.loop.create_future()
        with self._idle:
            self._pending += 1
        self._jobs.put((fn, args, kwargs, None, future, None, False))
        return future

    def drain(self, timeout: float = 10.0) -> bool:
        """Wait (on the calling thread) until every job asked for so far has run."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def stop(self, timeout: float = 10.0) -> None:
        """Run what is queued, then end the thread."""
        if self._thread is None:
            return
        self._jobs.put(_STOP)
        self._thread.join(timeout)
        self._thread = None

    @property
    def on_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            jobs = [job]
            stop = False
            # What is queued already joins it (nothing is waited for).
            while len(jobs) < GROUP_LIMIT:
                try:
                    more = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if more is _STOP:
                    stop = True
                    break
                jobs.append(more)
            if self.group is None or len(jobs) == 1:
                for one in jobs:
                    self._run_alone(one)
            else:
                self._run_grouped(jobs)
            if stop:
                return

    def _run_alone(self, job: Job) -> None:
        fn, args, kwargs, retry_full = job[0], job[1], job[2], job[6]
        began = time.monotonic()
        try:
            result = self._attempt(fn, args, kwargs, retry_full)
            metrics.transaction(_name(fn), time.monotonic() - began)
        except BaseException as exc:
            self._failed(job, exc)
        else:
            self._succeeded(job, result)
        finally:
            self._done(1)

    def _run_grouped(self, jobs: list[Job]) -> None:
        """Run `jobs` in group transactions (see the module docstring), in order."""
        assert self.group is not None
        i = 0
        while i < len(jobs):
            start = i
            outcomes: list[tuple[Job, bool, Any]] = []
            alone: Job | None = None
            try:
                with self.group():
                    while i < len(jobs):
                        job = jobs[i]
                        fn, args, kwargs = job[0], job[1], job[2]
                        began = time.monotonic()
                        try:
                            result = fn(*args, **kwargs)
                        except Exception as exc:
                            if is_locked(exc) or is_storage_full(exc):
                                alone = job  # after the commit of those before it
                                i += 1
                                break
                            outcomes.append((job, False, exc))
                        else:
                            metrics.transaction(_name(fn), time.monotonic() - began)
                            outcomes.append((job, True, result))
                        i += 1
            except Exception as exc:
                # The group's begin or commit failed: none of it was written. Each job runs
                # again alone, as it would have without the group.
                log.warning(
                    "%s: a group of %d jobs failed (%s); running them one by one",
                    self.name,
                    i - start,
                    exc,
                )
                if i == start:
                    # It could not even begin (the database stayed locked): the first job
                    # waits and retries alone, as without the group, then grouping goes on.
                    i += 1
                for job in jobs[start:i]:
                    self._run_alone(job)
                continue
            self._to_loop(self._settle_all, outcomes)
            self._done(len(outcomes))
            if alone is not None:
                self._run_alone(alone)

    def _settle_all(self, outcomes: list[tuple[Job, bool, Any]]) -> None:
        # (the loop) A group's results, in order, after its commit.
        for job, ok, value in outcomes:
            _, _, _, then, future, on_error, _ = job
            if future is not None:
                _settle(future, None if not ok else value, None if ok else value)
            elif ok:
                if then is not None:
                    then(value)
            elif on_error is not None:
                log.error("%s: %s failed: %s", self.name, _name(job[0]), value)
                on_error(value)
            else:
                log.error("%s: %s failed", self.name, _name(job[0]), exc_info=value)

    def _succeeded(self, job: Job, result: Any) -> None:
        then, future = job[3], job[4]
        if future is not None:
            self._resolve(future, result=result)
        elif then is not None:
            self._to_loop(then, result)

    def _failed(self, job: Job, exc: BaseException) -> None:
        fn, future, on_error = job[0], job[4], job[5]
        if future is not None:
            self._resolve(future, exc=exc)
        elif on_error is not None:
            log.error("%s: %s failed: %s", self.name, getattr(fn, "__name__", fn), exc)
            self._to_loop(on_error, exc)
        else:
            log.exception("%s: %s failed", self.name, getattr(fn, "__name__", fn))

    def _done(self, n: int) -> None:
        with self._idle:
            self._pending -= n
            if self._pending == 0:
                self._idle.notify_all()

    def _attempt(self, fn: Callable[..., Any], args: Any, kwargs: Any, retry_full: bool) -> Any:
        attempt = 0
        while True:
            try:
                return fn(*args, **kwargs)
            except Exception as exc:
                if not (is_locked(exc) or (retry_full and is_storage_full(exc))):
                    raise
                pause = RETRY_PAUSES[min(attempt, len(RETRY_PAUSES) - 1)]
                if attempt % 10 == 0:
                    log.warning(
                        "%s: the database stayed locked (%s); trying %s again",
                        self.name,
                        exc,
                        getattr(fn, "__name__", fn),
                    )
                attempt += 1
                time.sleep(pause)

    def _to_loop(self, fn: Callable[..., Any], *args: Any) -> None:
        loop = self.loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile (shutdown)
            loop.call_soon_threadsafe(fn, *args)

    def _resolve(
        self, future: asyncio.Future[Any], result: Any = None, exc: BaseException | None = None
    ) -> None:
        self._to_loop(_settle, future, result, exc)


def _settle(future: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__name__", "job").lstrip("_")
