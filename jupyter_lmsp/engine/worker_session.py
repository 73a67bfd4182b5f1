"""One inference worker process and what serves its pipe (`WorkerSession`), and the one thread
every worker is spawned from (`spawner`); `client.EngineClient` drives them.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing.connection
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import TypeVar

from jupyter_lmsp.engine.frames import FrameReader

T = TypeVar("T")


class Spawner:
    """Starts worker processes from one daemon thread that lives as long as this process.

    Why: the worker asks Linux (PR_SET_PDEATHSIG) to kill it when its parent dies, and Linux
    counts the parent as dead when the *thread* that spawned it exits. Spawning from a
    short-lived thread (an executor thread, the reader thread restarting after a crash) would
    kill a healthy worker when that thread ends.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tasks: queue.SimpleQueue[tuple[Callable[[], object], concurrent.futures.Future]] = (
            queue.SimpleQueue()
        )
        self._thread: threading.Thread | None = None

    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run `fn` on the spawner thread; its future resolves when it has run."""
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._loop, name="lmsp-engine-spawner", daemon=True
                )
                self._thread.start()
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._tasks.put((fn, future))
        return future

    def _loop(self) -> None:
        while True:
            fn, future = self._tasks.get()
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)


spawner = Spawner()


@dataclass(eq=False)
class WorkerSession:
    """One worker process and the threads serving its pipe.

    `process` and `conn` are None until the spawner thread has launched it (`launched` set);
    jobs submitted before wait in `outbox`.
    """

    process: BaseProcess | None = None
    conn: Connection | None = None
    launched: threading.Event = field(default_factory=threading.Event)
    outbox: queue.SimpleQueue[object] = field(default_factory=queue.SimpleQueue)
    # Job ids submitted and not yet ended; a dict keeps submission order.
    in_flight: dict[str, None] = field(default_factory=dict)
    stopping: bool = False
    exited: bool = False
    # Set when its `WorkerReady` has been read: until then it is importing MLX and reads no
    # message.
    ready: bool = False
    reader: threading.Thread | None = None
    writer: threading.Thread | None = None
    # Its pipe's reader, when the messages are read on an event loop (`EngineClient(loop=)`).
    frames: FrameReader | None = None
    # The reader thread and stop() both wait for the process. Two threads in waitpid race
    # (one reaps, the other gets ECHILD and reports the process alive), so reaping and
    # polling happen under this lock, and waiting on the sentinel (which reaps nothing)
    # outside it.
    reap_lock: threading.Lock = field(default_factory=threading.Lock)

    def wait(self, timeout: float) -> bool:
        """Wait up to `timeout` for the process to exit and reap it; True if it has."""
        if self.process is None:
            return True
        if not multiprocessing.connection.wait([self.process.sentinel], timeout):
            return False
        with self.reap_lock:
            # The sentinel closes as the process exits, so this blocking reap is brief.
            self.process.join()
        return True

    def is_alive(self) -> bool:
        with self.reap_lock:
            return self.process is not None and self.process.exitcode is None

    def exitcode(self) -> int | None:
        with self.reap_lock:
            return None if self.process is None else self.process.exitcode

    def kill(self) -> None:
        with self.reap_lock:
            if self.process is not None:
                self.process.kill()
