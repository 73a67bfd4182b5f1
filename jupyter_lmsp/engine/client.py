"""`EngineClient`: the server process's handle on the inference worker process.

The client starts the worker (`worker.worker_main`, through `worker_entry`) with the
multiprocessing *spawn* context, sends it jobs and cancels, and hands every message from it to
an `on_message` callback: on the caller's event loop when it gives one (the loop's selector
watches the pipe, issue 42), else from the client's reader thread (the caller marshals to its
loop). When the worker dies without being asked to, the callback gets a `WorkerExited` listing
the jobs it took with it.

Nothing here blocks the caller: sends go through a queue to a writer thread, because a large
job can fill the pipe while the worker is busy in a prefill and not reading; and `start()`
returns at once, the worker being prepared (`prepare_env`, e.g. choosing its BLAS by probing
candidates for seconds) and spawned on the spawner thread while jobs wait in the queue.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import multiprocessing.connection
import os
import threading
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from multiprocessing.reduction import ForkingPickler
from typing import TypeVar

from jupyter_lmsp.engine.frames import FrameReader, Unreadable
from jupyter_lmsp.engine.messages import (
    CancelJob,
    EmbedJob,
    GenerateJob,
    JobCancelled,
    JobComing,
    JobFailed,
    JobFinished,
    LoadModel,
    Shutdown,
    SlotsWanted,
    UnloadModel,
    WorkerExited,
    WorkerReady,
    WorkerSettings,
)
from jupyter_lmsp.engine.spawn import start_without_main
from jupyter_lmsp.engine.worker_entry import worker_main
from jupyter_lmsp.engine.worker_session import WorkerSession, spawner

T = TypeVar("T")

# os.environ is process-wide: one lock for every client that sets it around a spawn.
_ENVIRON_LOCK = threading.Lock()
_STOP_WRITER = object()


class EngineNotRunning(RuntimeError):
    """A job was submitted while no worker process is running."""


class EngineClient:
    """Proxy for the inference worker process.

    `on_message(msg)` receives every worker message (`WorkerReady`, `JobStarted`, `StepTokens`
    (a step's `JobTokens`, one call for all its rows), `JobTokens`, `JobFinished`, `JobFailed`,
    `JobCancelled`) and `WorkerExited`, in order, from the reader thread; it must not block
    for long. Given a `loop`, the messages are read on that event loop instead (its selector
    watches the pipe: no thread wakes up per message, and no hand-off to the loop follows,
    issue 42) and `on_message` is called there, `WorkerExited` excepted (from a thread of its
    own, after the worker is reaped). `env` entries are added to (or override) the worker's
    environment; the server's own environment is unchanged. `prepare_env`, if given, is called
    on the spawner thread before each spawn (never on the caller's thread: it may take seconds)
    and its entries are added too, e.g. the chosen BLAS's `LD_PRELOAD`.
    `settings` are the worker's (`messages.WorkerSettings`); `token_delay` is its test hook
    (see `worker.worker_main`).
    """

    def __init__(
        self,
        on_message: Callable[[object], None],
        *,
        token_delay: float = 0.0,
        settings: WorkerSettings | None = None,
        env: Mapping[str, str] | None = None,
        prepare_env: Callable[[], Mapping[str, str]] | None = None,
        log: logging.Logger | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self._on_message = on_message
        self._loop = loop
        self._token_delay = token_delay
        self._settings = settings or WorkerSettings()
        self._env = dict(env) if env else {}
        self._prepare_env = prepare_env
        self._log = log or logging.getLogger(__name__)
        self._lock = threading.Lock()
        self._session: WorkerSession | None = None
        self._slots_wanted = 0

    # --- state -----------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        session = self._session
        return session is not None and not session.exited and session.is_alive()

    @property
    def pid(self) -> int | None:
        session = self._session
        if session is None or session.process is None:
            return None
        return session.process.pid

    @property
    def in_flight(self) -> list[str]:
        with self._lock:
            return list(self._session.in_flight) if self._session is not None else []

    # --- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Start the worker process; its `WorkerReady` arrives through `on_message`.

        Returns at once: the spawn happens on the spawner thread, after `prepare_env`. Jobs
        submitted meanwhile are sent once the worker runs. A spawn that fails is reported as a
        `WorkerExited` (pid 0) with the jobs submitted meanwhile.
        """
        with self._lock:
            if self._session is not None and not self._session.exited:
                raise RuntimeError("the engine worker is already running")
            session = WorkerSession()
            self._session = session
            if self._slots_wanted:
                session.outbox.put(SlotsWanted(self._slots_wanted))
        spawner.submit(lambda: self._launch(session))

    def _launch(self, session: WorkerSession) -> None:
        """On the spawner thread: prepare the environment, spawn, start the pipe's threads."""
        try:
            env = dict(self._env)
            if self._prepare_env is not None:
                env.update(self._prepare_env())
            if session.stopping:  # stop() came while the environment was prepared
                with self._lock:
                    session.exited = True
                session.launched.set()
                return
            session.process, session.conn = self._spawn(env)
        except Exception:
            self._log.exception("could not start the engine worker")
            with self._lock:
                session.exited = True
                lost = list(session.in_flight)
                session.in_flight.clear()
                unexpected = not session.stopping
            session.launched.set()
            if unexpected:
                self._deliver(WorkerExited(0, None, lost))
            return
        pid = session.process.pid
        session.writer = threading.Thread(
            target=self._write, args=(session,), name=f"lmsp-engine-writer-{pid}"
        )
        # Daemons, so a server that exits without stop() is not held up; the worker then
        # notices its parent is gone by itself.
        session.writer.daemon = True
        session.writer.start()
        if not self._watch_on_loop(session):
            session.reader = threading.Thread(
                target=self._read, args=(session,), name=f"lmsp-engine-reader-{pid}", daemon=True
            )
            session.reader.start()
        session.launched.set()
        self._log.info("engine worker started (pid %s)", pid)

    def _spawn(self, env: Mapping[str, str]) -> tuple[BaseProcess, Connection]:
        ctx = multiprocessing.get_context("spawn")
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        process = ctx.Process(
            target=worker_main,
            args=(child_conn, self._token_delay, os.getpid(), self._settings),
            name="lmsp-engine-worker",
            daemon=True,
        )
        with _ENVIRON_LOCK:
            # Spawn copies the parent's environment at start, so the worker's variables are
            # set here for the moment of the start only.
            saved = {name: os.environ.get(name) for name in env}
            try:
                os.environ.update(env)
                # Not `process.start()`: a `jupyter server` started as a script would run again
                # in the worker (engine/spawn.py).
                start_without_main(process)
            finally:
                for name, value in saved.items():
                    if value is None:
                        os.environ.pop(name, None)
                    else:
                        os.environ[name] = value
        # Our copy of the child's end must go, or we would never see EOF when the worker dies.
        child_conn.close()
        return process, parent_conn

    def stop(self, timeout: float = 5.0) -> None:
        """Ask the worker to shut down, wait up to `timeout`, then kill it. Idempotent.

        A worker not ready yet that holds no job is ended at once."""
        with self._lock:
            session = self._session
            if session is None:
                return
            session.stopping = True
        if not session.exited:
            session.outbox.put(Shutdown())
        if not session.launched.wait(timeout):
            # Still preparing its environment: it will not spawn now that it is stopping.
            with self._lock:
                session.exited = True
                if self._session is session:
                    self._session = None
            return
        with self._lock:
            unready_and_idle = not session.ready and not session.in_flight
        if unready_and_idle:
            # A worker that has not said it is ready is still importing MLX (seconds of CPU)
            # and would read the shutdown only once done; it holds no job, so a polite
            # shutdown would keep nothing: end it now.
            session.kill()
        if not session.wait(timeout):
            pid = session.process.pid if session.process is not None else None
            self._log.warning("engine worker %s did not stop; killing it", pid)
            session.kill()
            session.wait(timeout)
        # stop() may be called from on_message, i.e. from the reader thread itself. (Read on
        # the loop, the thread that reaps is started when the loop reads the pipe's end.)
        reader = session.reader
        if reader is not None and reader is not threading.current_thread():
            reader.join(timeout)
        with self._lock:
            if self._session is session:
                self._session = None

    def restart(self) -> None:
        """Stop the current worker (if any, e.g. after a crash) and start a fresh one."""
        self.stop()
        self.start()

    # --- jobs ------------------------------------------------------------------------------

    def submit(self, job: GenerateJob) -> None:
        """Queue `job` for the worker. Raises `EngineNotRunning` if there is no live worker."""
        with self._lock:
            session = self._session
            if session is None or session.exited or session.stopping:
                raise EngineNotRunning("the engine worker is not running")
            session.in_flight[job.job_id] = None
            session.outbox.put(job)

    def send(self, message: EmbedJob | CancelJob | LoadModel | UnloadModel) -> None:
        """Send a message outside the task path (an `EmbedJob` or the `CancelJob` of one, a
        `LoadModel`, an `UnloadModel`).
        Its answer comes through `on_message` like the others; a worker that dies first takes
        it without a `WorkerExited` naming it (the caller fails what it waits for on any
        `WorkerExited`). Raises `EngineNotRunning` if there is no live worker."""
        with self._lock:
            session = self._session
            if session is None or session.exited or session.stopping:
                raise EngineNotRunning("the engine worker is not running")
            session.outbox.put(message)

    def announce(self, job_id: str) -> None:
        """Tell the worker that `job_id` will be submitted shortly (see `JobComing`)."""
        with self._lock:
            session = self._session
            if session is None or session.exited or session.stopping:
                return
            session.outbox.put(JobComing(job_id))

    @property
    def slots_wanted(self) -> int:
        """The count of tasks waiting for a batch row the worker was last told."""
        return self._slots_wanted

    def tell_slots_wanted(self, count: int) -> None:
        """Record how many tasks wait for a batch row and tell the worker (`SlotsWanted`) when
        whether any wait changed; a worker started later is told too."""
        with self._lock:
            if count == self._slots_wanted:
                return
            # The worker acts on whether any task waits, not on how many: a burst of creates
            # would otherwise send it a message (and wake it) per create.
            changed = (count > 0) != (self._slots_wanted > 0)
            self._slots_wanted = count
            if not changed:
                return
            session = self._session
            if session is None or session.exited or session.stopping:
                return
            session.outbox.put(SlotsWanted(count))

    def cancel(self, job_id: str) -> None:
        """Ask the worker to cancel `job_id`; a `JobCancelled` follows unless it already ended."""
        with self._lock:
            session = self._session
            if session is None or session.exited or job_id not in session.in_flight:
                return
            session.outbox.put(CancelJob(job_id))

    # --- threads ---------------------------------------------------------------------------

    def _deliver(self, message: object) -> None:
        try:
            self._on_message(message)
        except Exception:
            self._log.exception("engine on_message failed for %r", type(message).__name__)

    def _write(self, session: WorkerSession) -> None:
        assert session.conn is not None
        while True:
            message = session.outbox.get()
            if message is _STOP_WRITER:
                return
            try:
                # Pickled first, so an unpicklable job fails alone instead of half-written.
                data = ForkingPickler.dumps(message)
            except Exception as exc:
                self._log.exception("cannot send %r to the engine worker", message)
                if isinstance(message, GenerateJob):
                    self._end_job(session, message.job_id)
                    self._deliver(JobFailed(message.job_id, "invalid_request", str(exc)))
                continue
            try:
                session.conn.send_bytes(data)
            except (OSError, ValueError):
                # The worker is gone; the reader sees EOF and reports the lost jobs.
                self._log.debug("engine worker pipe closed; dropping %r", message)

    def _end_job(self, session: WorkerSession, job_id: str) -> None:
        with self._lock:
            session.in_flight.pop(job_id, None)

    def _read(self, session: WorkerSession) -> None:
        """(the reader thread) Every message, in order, until the pipe closes."""
        assert session.conn is not None
        # Every message the pipe holds in one read (`frames`), not two reads per message.
        frames = FrameReader(session.conn.fileno())
        while True:
            try:
                messages = frames.read()
            except (EOFError, OSError):
                break
            self._received(session, messages)
        self._ended(session)

    def _watch_on_loop(self, session: WorkerSession) -> bool:
        """(the spawner thread) Have the loop read the pipe; False without a loop (or with
        one that is closed): a reader thread then reads it."""
        if self._loop is None:
            return False
        assert session.conn is not None
        session.frames = FrameReader(session.conn.fileno())
        try:
            self._loop.call_soon_threadsafe(self._watch, session)
        except RuntimeError:  # the loop is closed: the server is stopping
            session.frames.close()
            session.frames = None
            return False
        return True

    def _watch(self, session: WorkerSession) -> None:
        assert self._loop is not None and session.conn is not None
        self._loop.add_reader(session.conn.fileno(), self._readable, session)

    def _readable(self, session: WorkerSession) -> None:
        """(the loop) What the pipe holds now; at its end, the worker is reaped on a thread."""
        assert self._loop is not None and session.conn is not None and session.frames
        try:
            messages = session.frames.read_ready()
        except (EOFError, OSError):
            self._loop.remove_reader(session.conn.fileno())
            session.frames.close()
            pid = session.process.pid if session.process is not None else 0
            ended = threading.Thread(
                target=self._ended, args=(session,), name=f"lmsp-engine-ended-{pid}", daemon=True
            )
            session.reader = ended
            ended.start()
            return
        self._received(session, messages)

    def _received(self, session: WorkerSession, messages: list[object]) -> None:
        for message in messages:
            if isinstance(message, Unreadable):
                self._log.error("unreadable message from the engine worker: %s", message)
                continue
            if isinstance(message, JobFinished | JobFailed | JobCancelled):
                self._end_job(session, message.job_id)
            elif isinstance(message, WorkerReady):
                with self._lock:
                    session.ready = True
            self._deliver(message)

    def _ended(self, session: WorkerSession) -> None:
        """(a thread) The pipe closed: reap the worker, stop the writer, and say which jobs
        were lost if nobody asked it to stop."""
        assert session.conn is not None and session.process is not None
        session.wait(5.0)
        exitcode = session.exitcode()
        with self._lock:
            session.exited = True
            unexpected = not session.stopping
            lost = list(session.in_flight)
            session.in_flight.clear()
        session.outbox.put(_STOP_WRITER)
        if session.writer is not None:
            session.writer.join(5.0)
        session.conn.close()
        pid = session.process.pid or 0
        if unexpected:
            self._log.error(
                "engine worker %s exited unexpectedly (exit code %s) with %d job(s) in flight",
                pid,
                exitcode,
                len(lost),
            )
            self._deliver(WorkerExited(pid, exitcode, lost))
        else:
            self._log.info("engine worker %s stopped", pid)
