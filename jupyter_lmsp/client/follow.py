"""Following one task's event log across disconnects: every event exactly once, in order.

`EventFollower` is the logic every watcher shares (`Client.follow`, `Client.wait`, the
`TaskWatcher` widget). It reads an `EventSource` — the SSE stream after a sequence number, and
JSON pages of stored events — and keeps the last sequence number it handed out:

- an event at or below it is a duplicate (a reconnect overlapping what was seen) and is dropped;
- an event above it + 1 means a gap: the missing events are read from the stored log first, and
  if the log cannot fill it, the stream is reopened from the last good sequence number;
- a dropped connection or a retryable error (the server restarting, 5xx, 429) reopens the stream
  with `Last-Event-ID` = that sequence number, after a short backoff, until the terminal event.

The source is a protocol so the logic is testable without a server.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

import httpx

from .errors import APIError, SequenceGapError
from .objects import Event

StatusCallback = Callable[[str, str], None]


class EventStream(Protocol):
    """An open stream of events (dicts with `sequence_number` and `type`)."""

    def __iter__(self) -> Iterator[dict[str, Any]]: ...

    def close(self) -> None: ...


class EventSource(Protocol):
    def stream(self, after: int) -> EventStream:
        """Open the live stream of the events after sequence number `after`."""
        ...

    def page(self, after: int, limit: int) -> tuple[list[dict[str, Any]], bool]:
        """Stored events after `after` (at most `limit`), and whether there are more."""
        ...


def is_retryable(exc: BaseException) -> bool:
    """Errors a follower waits out: the network, a restarting server, 5xx, 408/409/429."""
    if isinstance(exc, httpx.TransportError | ConnectionError | SequenceGapError):
        return True
    return isinstance(exc, APIError) and exc.retryable


class EventFollower:
    """Iterate over a task's events after `after`, surviving disconnects (see module doc).

    `on_status(status, detail)` is called with `connecting`, `live`, `reconnecting`, `done` or
    `closed`. `max_downtime` bounds how long the follower keeps retrying without receiving an
    event (None: until `close()`). Counters `reconnects`, `duplicates_dropped` and
    `gaps_filled` say what it had to repair.
    """

    def __init__(
        self,
        source: EventSource,
        after: int = -1,
        *,
        on_status: StatusCallback | None = None,
        backoff: tuple[float, float] = (0.2, 2.0),
        max_downtime: float | None = None,
        page_limit: int = 1000,
    ) -> None:
        self.source = source
        self.last_sequence_number = after
        self.on_status = on_status
        self.backoff = backoff
        self.max_downtime = max_downtime
        self.page_limit = page_limit
        self.done = False
        self.reconnects = 0
        self.duplicates_dropped = 0
        self.gaps_filled = 0
        self.last_error: BaseException | None = None
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._stream: EventStream | None = None

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def close(self) -> None:
        """Stop following; safe to call from another thread (it closes the open stream)."""
        self._closed.set()
        with self._lock:
            stream = self._stream
        if stream is not None:
            with contextlib.suppress(Exception):
                stream.close()

    def _status(self, status: str, detail: str = "") -> None:
        if self.on_status is not None:
            self.on_status(status, detail)

    def __iter__(self) -> Iterator[Event]:
        delay = self.backoff[0]
        failing_since: float | None = None
        first = True
        while not self.closed and not self.done:
            self._status("connecting" if first else "reconnecting", self._describe_error())
            first = False
            try:
                stream = self.source.stream(self.last_sequence_number)
                with self._lock:
                    self._stream = stream
                if self.closed:
                    stream.close()
                    break
                self._status("live")
                try:
                    for raw in stream:
                        for event in self._accept(raw):
                            failing_since, delay = None, self.backoff[0]
                            yield event
                            if event.terminal:
                                self.done = True
                                self._status("done")
                                return
                finally:
                    with self._lock:
                        self._stream = None
                    stream.close()
                # The stream ended without a terminal event (server going down): reconnect.
                self.last_error = ConnectionError("the event stream ended early")
            except BaseException as exc:
                if self.closed:
                    break
                if not is_retryable(exc):
                    raise
                self.last_error = exc
            if self.closed:
                break
            now = time.monotonic()
            failing_since = failing_since if failing_since is not None else now
            if self.max_downtime is not None and now - failing_since > self.max_downtime:
                assert self.last_error is not None
                raise self.last_error
            self.reconnects += 1
            self._status("reconnecting", self._describe_error())
            self._closed.wait(delay)
            delay = min(delay * 2, self.backoff[1])
        if not self.done:
            self._status("closed")

    def _describe_error(self) -> str:
        if self.last_error is None:
            return ""
        return f"{type(self.last_error).__name__}: {self.last_error}"

    def _accept(self, raw: dict[str, Any]) -> Iterable[Event]:
        """The events `raw` releases: none (a duplicate), itself, or a filled gap then itself."""
        event = Event.from_wire(raw)
        seq = event.sequence_number
        if seq <= self.last_sequence_number:
            self.duplicates_dropped += 1
            return []
        out: list[Event] = []
        if seq > self.last_sequence_number + 1:
            out.extend(self._fill_gap(seq))
            self.gaps_filled += 1
        out.append(event)
        self.last_sequence_number = seq
        return out

    def _fill_gap(self, upto: int) -> list[Event]:
        """Stored events between the last one seen and `upto` (exclusive), all of them."""
        missing: list[Event] = []
        after = self.last_sequence_number
        while after < upto - 1:
            page, has_more = self.source.page(after, self.page_limit)
            progressed = False
            for raw in page:
                seq = int(raw["sequence_number"])
                if seq <= after:
                    continue
                if seq != after + 1:
                    break
                if seq >= upto:
                    break
                missing.append(Event.from_wire(raw))
                after = seq
                progressed = True
            if not progressed or (not has_more and after < upto - 1):
                # The log cannot fill it: reopen the stream from the last good event instead.
                raise SequenceGapError(after + 1, upto)
        return missing
