"""Following a task's event log: stored events after a sequence number, then live ones.

The subscription is opened before the replay query, so an event committed between the two is
in the queue; anything at or below the last sequence number already yielded is dropped. The
result is every event after `after`, exactly once, in order, with no gap, until the terminal
event. Both reads of the log (the replay, and a gap's fill) run through `offload`, on a database
thread: the IOLoop never waits on the database. Whichever server drives the task: events another server commits reach this server's
bus through `services.feed`, from the end of the replay on.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncGenerator, Callable
from typing import Any

from ..protocol.events import ITEM_ADDED, is_terminal
from ..protocol.objects import with_namespace, with_namespaces
from ..store import queries
from ..store.database import Database
from . import metrics
from .bus import CLOSED, EventBus, Subscription
from .lifecycle import Offload

Event = dict[str, Any]
# What a stream shows of a stored event: the event (as is or reshaped), or None to skip it.
View = Callable[[Event], Event | None]


class TaskEventStream:
    """An async iterator over a task's events after `after`: None after `idle` seconds without
    one (the caller writes a keep-alive), and the end after the terminal event.

    `ready` says whether the next event is already at hand, so a writer can send several in
    one flush (the four or five events of a task's end arrive together).

    `caller` names the paired client the stream serves: the stream ends early, without its
    terminal event, when that client is revoked (`EventBus.close_caller`).

    `view` reshapes each event as this stream shows it, or skips it (None): the OpenAI-shaped
    streams show only the spec's event types (`spec_view`). The log itself is unchanged."""

    def __init__(
        self,
        db: Database,
        bus: EventBus,
        task_id: str,
        after: int = -1,
        idle: float = 15.0,
        caller: str | None = None,
        *,
        offload: Offload,
        view: View | None = None,
    ) -> None:
        self.db, self.bus, self.task_id, self.after, self.idle = db, bus, task_id, after, idle
        self.offload = offload
        self.view = view
        self.caller = caller
        # Set when the stream ended because its caller was revoked (no terminal event came).
        self.revoked = False
        # Set once the terminal event was yielded: nothing follows it.
        self.ended = False
        self._replay: deque[Event] = deque()
        self._sub: Subscription | None = None
        self._events = self._follow()

    @property
    def ready(self) -> bool:
        return bool(self._replay) or (self._sub is not None and not self._sub.queue.empty())

    def __aiter__(self) -> TaskEventStream:
        return self

    async def __anext__(self) -> Event | None:
        while True:
            event = await self._events.__anext__()
            if event is None or self.view is None:
                return event
            shown = self.view(event)
            if shown is not None:
                return shown

    async def aclose(self) -> None:
        await self._events.aclose()

    async def _follow(self) -> AsyncGenerator[Event | None, None]:
        with self.bus.subscribe(self.task_id, self.caller) as sub:
            self._sub = sub
            last = self.after
            self._replay.extend(
                await self.offload(queries.list_events, self.db, self.task_id, last)
            )
            metrics.events_replayed(len(self._replay))
            # What the replay holds is read: the feed (events other servers commit) goes on
            # from there.
            sub.seen(self._replay[-1]["sequence_number"] if self._replay else last)
            while self._replay:
                event = self._replay.popleft()
                last = event["sequence_number"]
                if is_terminal(event):
                    self.ended = True
                yield event
                if self.ended:
                    return
            while True:
                item = await sub.get(timeout=self.idle)
                if item is None:
                    yield None
                    continue
                _, event = item
                if event is CLOSED:
                    self.revoked = True
                    return
                seq = event["sequence_number"]
                if seq <= last:
                    continue
                if seq > last + 1:
                    # Published events are contiguous, so a gap means this watcher fell behind
                    # a replay boundary; the database has the missing ones.
                    missed = await self.offload(queries.list_events, self.db, self.task_id, last)
                    for missing in missed:
                        if missing["sequence_number"] >= seq:
                            break
                        last = missing["sequence_number"]
                        metrics.events_replayed(1)
                        yield missing
                last = seq
                if is_terminal(event):
                    self.ended = True
                yield event
                if self.ended:
                    return


# LMSP's own lifecycle events, and what the spec's streams show instead: `response.loading`
# (the model loads; the response is still `queued`) as `response.queued`, `response.cancelling`
# not at all (the terminal event follows), and the end of a cancelled response as
# `response.incomplete` (the spec has no cancelled event; its response says `cancelled`).
# `/tasks/{id}/events` shows the log as it is.
SPEC_RENAMED = {
    "response.loading": "response.queued",
    "response.cancelled": "response.incomplete",
}
SPEC_HIDDEN = frozenset({"response.cancelling"})


# Lifecycle events before the end: their snapshot holds only the items already added.
INTERIM = frozenset({"response.created", "response.queued", "response.in_progress"})


def spec_view(
    namespaces: dict[str, str] | None = None,
    *,
    from_start: bool = True,
    seal: Callable[[list[dict[str, Any]]], list[dict[str, Any]]] | None = None,
) -> View:
    """The view of the OpenAI-shaped streams (`POST /responses` with `stream`, `GET
    /responses/{id}?stream=true`): only the Open Responses spec's event types, sequence numbers
    kept (a hidden event leaves a gap, which clients allow), and each call of a namespaced
    function naming its namespace.

    Read from the start (`from_start`), an interim lifecycle event's snapshot lists only the
    items whose `response.output_item.added` came before it, as the openai SDKs' stream helpers
    expect (the Node one refuses an item twice as a duplicate output index). The store commits
    `response.in_progress` that way (`rules.start_running`); logs committed before it did
    (earlier releases' rows, still within retention) listed the attempt's open message there,
    and are shown as the store writes them now."""
    added: set[str] = set()

    def show(event: Event) -> Event | None:
        kind = event.get("type")
        if kind in SPEC_HIDDEN:
            return None
        if kind in SPEC_RENAMED:
            event = {**event, "type": SPEC_RENAMED[kind]}
            kind = event["type"]
        if kind == ITEM_ADDED and isinstance(event.get("item"), dict):
            added.add(event["item"].get("id"))
        elif kind in INTERIM and from_start:
            event = _only_added(event, added)
        if namespaces:
            event = _namespaced(event, namespaces)
        if seal is not None:
            event = _sealed(event, seal)
        return event

    return show


def _only_added(event: Event, added: set[str]) -> Event:
    response = event.get("response")
    if not isinstance(response, dict) or not response.get("output"):
        return event
    output = [item for item in response["output"] if item.get("id") in added]
    return {**event, "response": {**response, "output": output}}


def _sealed(event: Event, seal: Callable[[list[dict[str, Any]]], list[dict[str, Any]]]) -> Event:
    """`event` with its reasoning items' thinking sealed (`include: ["reasoning.
    encrypted_content"]`): the done item and the output of a lifecycle event's response."""
    item = event.get("item")
    if isinstance(item, dict):
        if item.get("type") == "reasoning" and event.get("type") == "response.output_item.done":
            return {**event, "item": seal([item])[0]}
        return event
    response = event.get("response")
    if isinstance(response, dict) and response.get("output"):
        return {**event, "response": {**response, "output": seal(response["output"])}}
    return event


def _namespaced(event: Event, namespaces: dict[str, str]) -> Event:
    if isinstance(event.get("item"), dict):
        return {**event, "item": with_namespace(event["item"], namespaces)}
    response = event.get("response")
    if isinstance(response, dict) and response.get("output"):
        return {
            **event,
            "response": {**response, "output": with_namespaces(response["output"], namespaces)},
        }
    return event
