"""A request to the inference worker that its caller awaits (an embedding, a model load or
unload): the message sent, a future in `waiting` the worker's reply answers, and the job
cancelled in the worker when the caller goes away."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from ..engine.client import EngineNotRunning
from ..engine.messages import CancelJob
from ..protocol.errors import LMSPError


async def ask_engine(
    engine: Any, waiting: dict[str, asyncio.Future[Any]], job_id: str, message: object
) -> Any:
    """Send `message` and await the reply that sets `waiting[job_id]`; a 503 while the worker
    is (re)starting."""
    future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    waiting[job_id] = future
    try:
        engine.send(message)
    except EngineNotRunning:
        waiting.pop(job_id, None)
        raise LMSPError(
            503, "worker_restarting", "The inference worker is starting; retry shortly."
        ) from None
    try:
        return await future
    except asyncio.CancelledError:
        # The caller went away: the worker need not do the work.
        waiting.pop(job_id, None)
        with contextlib.suppress(EngineNotRunning):
            engine.send(CancelJob(job_id))
        raise
