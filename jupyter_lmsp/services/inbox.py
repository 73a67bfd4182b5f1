"""Messages from another thread handed to the event loop in batches (issue 42).

An engine read by a thread (`EngineClient` without a loop) receives one message per decode
step, hundreds a second for a small model. Handing each to the loop on its own
(`call_soon_threadsafe`) costs a wake-up of the loop (a write to its self-pipe, a `select`, a
callback) per step. An `Inbox` keeps the
messages in order and asks the loop for one call only when none is pending: that call takes
every message that arrived before the loop got to it. A loop that keeps up still runs each step
as it comes; one that is busy takes the steps that piled up in one turn. Messages read on
the loop itself (`handle_now`) are handled at once, after any a thread put before them.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable


class Inbox:
    def __init__(self, handle: Callable[[object], None]) -> None:
        # Called on the loop with each message, in the order they were put.
        self.handle = handle
        self.loop: asyncio.AbstractEventLoop | None = None
        self._messages: list[object] = []
        self._lock = threading.Lock()
        # Whether a call of `_drain` is asked for and has not yet taken the messages.
        self._called = False

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def put(self, message: object) -> None:
        """(any thread) Hand `message` to the loop, after those put before it."""
        assert self.loop is not None
        with self._lock:
            self._messages.append(message)
            if self._called:
                return
            self._called = True
        self.loop.call_soon_threadsafe(self._drain)

    def handle_now(self, message: object) -> None:
        """(the loop) Handle `message` at once, after the messages put before it (the drain
        asked for them then finds none)."""
        with self._lock:
            messages, self._messages = self._messages, []
        for earlier in messages:
            self.handle(earlier)
        self.handle(message)

    def _drain(self) -> None:
        with self._lock:
            messages, self._messages = self._messages, []
            self._called = False
        for message in messages:
            self.handle(message)
