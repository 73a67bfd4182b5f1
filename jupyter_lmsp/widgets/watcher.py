"""`TaskWatcher`: a live view of one task — state, model, elapsed time, tokens per second, the
text as it arrives, the last events with their sequence numbers, and a Cancel button.

A daemon thread in the kernel follows the task's event log with `Client.follow` and sets the
synced traits (JupyterLab shows trait changes made from any thread). The follower reconnects
with `Last-Event-ID` = the last sequence number seen, so a server restart shows as a short
"reconnecting" and then the text goes on with no piece doubled or missing. After a kernel
restart, a new `TaskWatcher(task_id)` rebuilds the same view from the durable log (replay from
sequence 0, then live), since the old kernel's memory is gone.

When the kernel can no longer update the view (its server was killed and restarted: the
browser's link to the kernel is gone; the kernel died), the view follows the task itself: the
kernel sends a heartbeat every second while it follows, and a view that misses it for a few
seconds reads the task's events from the service in the browser, from the last sequence number
it shows, saying "reconnecting" / "server unavailable" while the server is gone (watcher.js).
The event → state map it folds them with is the service's (`protocol.states`), sent as a trait.

The view is an anywidget ES module shipped in this package (`static/watcher.js`): no build
step, nothing loaded from a CDN.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import anywidget
import traitlets

from ..client import Client, Response, Task, default_client
from ..client.follow import EventFollower, is_retryable
from .state import EVENT_STATES, TERMINAL_STATES, TokenCounter, WatcherState, tokenizer_counter

STATIC = Path(__file__).parent / "static"
# Trait pushes for text are coalesced to this interval; state changes go out at once.
PUSH_INTERVAL = 0.1
# How often the kernel tells the view it is still following (see the module docstring).
HEARTBEAT_INTERVAL = 1.0


def _read(name: str) -> str:
    return (STATIC / name).read_text(encoding="utf-8")


def _model_path(client: Client, model_id: str | None) -> str | None:
    """Where the service keeps a model (the kernel usually shares its machine)."""
    if not model_id:
        return None
    cache: dict[str, str | None] = client.__dict__.setdefault("_lmsp_model_paths", {})
    if model_id not in cache:
        try:
            cache[model_id] = client.model(model_id).path
        except Exception:
            cache[model_id] = None
    return cache[model_id]


class TaskWatcher(anywidget.AnyWidget):
    """Watch a task live: `TaskWatcher(task)`, `TaskWatcher(response)`, or an id of either."""

    _esm = _read("watcher.js")
    _css = _read("widgets.css")

    task_id = traitlets.Unicode("").tag(sync=True)
    response_id = traitlets.Unicode("").tag(sync=True)
    kind = traitlets.Unicode("response").tag(sync=True)
    model = traitlets.Unicode("").tag(sync=True)
    state = traitlets.Unicode("").tag(sync=True)
    status = traitlets.Unicode("").tag(sync=True)
    text = traitlets.Unicode("").tag(sync=True)
    # Function calls ({id, name, arguments, status}) and the output's format (`json_schema`…).
    calls = traitlets.List(traitlets.Dict()).tag(sync=True)
    format = traitlets.Unicode("text").tag(sync=True)
    error = traitlets.Dict().tag(sync=True)
    incomplete_reason = traitlets.Unicode("").tag(sync=True)
    created_at = traitlets.Float(0.0).tag(sync=True)
    finished_at = traitlets.Float(0.0).tag(sync=True)
    elapsed = traitlets.Float(0.0).tag(sync=True)
    tokens = traitlets.Int(0).tag(sync=True)
    tokens_exact = traitlets.Bool(False).tag(sync=True)
    tokens_per_second = traitlets.Float(-1.0).tag(sync=True)
    events = traitlets.List(traitlets.Dict()).tag(sync=True)
    last_sequence_number = traitlets.Int(-1).tag(sync=True)
    # connecting | live | reconnecting | done | closed | error
    connection = traitlets.Unicode("connecting").tag(sync=True)
    connection_detail = traitlets.Unicode("").tag(sync=True)
    reconnects = traitlets.Int(0).tag(sync=True)
    # The kernel's "still following" (time.time(), every HEARTBEAT_INTERVAL until the end), and
    # the service's event -> state map for the view's own following when it stops.
    heartbeat = traitlets.Float(0.0).tag(sync=True)
    event_states = traitlets.Dict(EVENT_STATES).tag(sync=True)
    terminal_states = traitlets.List(traitlets.Unicode(), sorted(TERMINAL_STATES)).tag(sync=True)

    def __init__(
        self,
        task: str | Task | Response,
        *,
        client: Client | None = None,
        max_events: int = 8,
        token_counter: TokenCounter | None = None,
        start: bool = True,
        **kwargs: Any,
    ) -> None:
        if isinstance(task, (Task, Response)):
            # In the widget's first state message, not a later update: a notebook saved right
            # after the cell ran must already show the model.
            kwargs.setdefault("model", task.model or "")
            if isinstance(task, Task):
                kwargs.setdefault("state", task.state)
            response_id = task.id if isinstance(task, Response) else task.response_id
            kwargs.setdefault("response_id", response_id or "")
        super().__init__(**kwargs)
        self.client: Client = client or getattr(task, "client", None) or default_client()
        self.task_id = self.client.task_id_of(task)
        self.max_events = max_events
        self.token_counter = token_counter
        self.follower: EventFollower | None = None
        self.view_state: WatcherState | None = None
        self._lock = threading.RLock()
        self._finished = threading.Event()
        self._stopped = threading.Event()
        self._last_push = 0.0
        self._push_timer: threading.Timer | None = None
        self._thread: threading.Thread | None = None
        self.on_msg(self._on_frontend_msg)
        if start:
            self.start()

    def __repr__(self) -> str:
        return f"TaskWatcher(task_id={self.task_id!r}, state={self.state or self.connection!r})"

    # -- public ----------------------------------------------------------------------------

    def start(self) -> None:
        """Start following (done by the constructor unless `start=False`)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(
            target=self._run, name=f"lmsp-watch-{self.task_id}", daemon=True
        )
        self._thread.start()
        threading.Thread(target=self._beat, name=f"lmsp-beat-{self.task_id}", daemon=True).start()

    def _beat(self) -> None:
        """The heartbeat, until the task is over (or the watcher stops)."""
        while not self._finished.is_set() and not self._stopped.is_set():
            with self._lock:
                self.heartbeat = time.time()
            self._stopped.wait(HEARTBEAT_INTERVAL)

    @property
    def finished(self) -> bool:
        """Whether the task is over and the view shows its final state."""
        return self._finished.is_set() and self.view_state is not None and self.view_state.finished

    def wait(self, timeout: float | None = None) -> TaskWatcher:
        """Block until the task is over and the view shows it; TimeoutError if it takes longer
        than `timeout`, RuntimeError if the watcher stopped first (closed, or an error)."""
        if not self._finished.wait(timeout):
            raise TimeoutError(f"task {self.task_id} still {self.state} after {timeout} s")
        if not self.finished:
            raise RuntimeError(
                f"watcher of {self.task_id} stopped ({self.connection}): {self.connection_detail}"
            )
        return self

    def cancel(self) -> Task:
        """Ask the service to cancel the task (what the Cancel button does)."""
        # The view shows the new state when the `response.cancelling` (or, for a task still
        # queued, `response.cancelled`) event arrives, like every other change.
        return self.client.cancel_task(self.task_id)

    def close(self) -> None:
        """Stop following and close the widget."""
        # ipywidgets calls close() from __del__, also of a watcher whose __init__ failed.
        if hasattr(self, "_stopped"):
            self._stopped.set()
            if self.follower is not None:
                self.follower.close()
            with self._lock:
                if self._push_timer is not None:
                    self._push_timer.cancel()
        super().close()

    # -- the following thread --------------------------------------------------------------

    def _run(self) -> None:
        try:
            task = self._first_look()
            if task is None:
                return
            counter = self.token_counter or tokenizer_counter(_model_path(self.client, task.model))
            with self._lock:
                self.view_state = WatcherState.from_task(
                    task.raw, max_events=self.max_events, count_tokens=counter
                )
            self._push()
            self.follower = self.client.follow(self.task_id, on_status=self._on_status)
            if self._stopped.is_set():
                self.follower.close()
            replayed_until = self.view_state.live_after
            for event in self.follower:
                with self._lock:
                    assert self.view_state is not None
                    self.view_state.apply(event)
                    self.reconnects = self.follower.reconnects
                # Text and the replay of what happened before we looked are coalesced; a live
                # state change shows at once.
                if (
                    event.type == "response.output_text.delta"
                    or event.sequence_number < replayed_until
                ):
                    self._schedule_push()
                else:
                    self._push()
            if self.follower.done:
                self._settle()
        except Exception as exc:  # shown in the widget: a thread has nowhere else to report
            with self._lock:
                self.connection = "error"
                self.connection_detail = f"{type(exc).__name__}: {exc}"
        finally:
            self._push()
            self._finished.set()

    def _first_look(self) -> Task | None:
        """The task as it is now, waiting out a server that is (re)starting."""
        delay = 0.2
        while not self._stopped.is_set():
            try:
                return self.client.get_task(self.task_id)
            except Exception as exc:
                if not is_retryable(exc):
                    raise
                self._on_status("reconnecting", f"{type(exc).__name__}: {exc}")
                self._stopped.wait(delay)
                delay = min(delay * 2, 2.0)
        return None

    def _settle(self) -> None:
        """After the terminal event: the task's exact finishing time."""
        try:
            task = self.client.get_task(self.task_id)
        except Exception:
            return
        with self._lock:
            assert self.view_state is not None
            if task.finished and task.finished_at is not None:
                self.view_state.finished_at = task.finished_at

    def _on_status(self, status: str, detail: str) -> None:
        with self._lock, self.hold_sync():
            self.connection = status
            self.connection_detail = detail

    # -- pushing state to the view ---------------------------------------------------------

    def _push(self) -> None:
        with self._lock:
            if self._push_timer is not None:
                self._push_timer.cancel()
                self._push_timer = None
            self._last_push = time.monotonic()
            if self.view_state is None:
                return
            values = self.view_state.to_traits()
            with self.hold_sync():
                for name, value in values.items():
                    if getattr(self, name) != value:
                        setattr(self, name, value)

    def _schedule_push(self) -> None:
        """Push now if the last push is old enough, else once the interval has passed."""
        with self._lock:
            wait = PUSH_INTERVAL - (time.monotonic() - self._last_push)
            if wait <= 0:
                self._push()
            elif self._push_timer is None:
                self._push_timer = threading.Timer(wait, self._push)
                self._push_timer.daemon = True
                self._push_timer.start()

    # -- messages from the view ------------------------------------------------------------

    def _on_frontend_msg(self, _widget: Any, content: dict[str, Any], _buffers: Any) -> None:
        if content.get("type") == "cancel":
            try:
                self.cancel()
            except Exception as exc:
                with self._lock:
                    self.connection_detail = f"cancel failed: {exc}"
