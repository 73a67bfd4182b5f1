"""The inference worker process's entry point as the server names it to multiprocessing.

A spawned child unpickles its target by module and name, so whatever module holds the target
is imported by the parent too, to name it. This one imports nothing: the worker itself (numpy,
the batching, the model loader, about 0.1 s of CPU and 200 modules) is imported by the child
only, never by the server.
"""

from __future__ import annotations

from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .messages import WorkerSettings


def worker_main(
    conn: Connection,
    token_delay: float = 0.0,
    parent_pid: int | None = None,
    settings: WorkerSettings | None = None,
) -> None:
    """`worker.worker_main`, imported in the child."""
    from .worker import worker_main as run

    run(conn, token_delay, parent_pid, settings)
