"""`TaskBoard`: every task of the service, live, filterable by state; a row opens a TaskWatcher.

A daemon thread follows the caller-wide lifecycle stream (`GET /lifecycle`): once it is open
the tasks are listed (`GET /tasks`, newest first, up to `max_rows`, the state filter applied by
the server), and from then on each transition of a task re-reads that task alone. A new filter
lists again. While the stream cannot be had (an older service, a network error) the thread
polls `GET /tasks` every `interval` seconds instead, and tries the stream again. Clicking a row
(or `board.open_task(task_id)`) shows a `TaskWatcher` for it under the table.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import anywidget
import ipywidgets
import traitlets

from ..client import Client, Task, default_client
from .watcher import TaskWatcher, _read

STATES = ("queued", "loading", "running", "cancelling", "completed", "failed", "cancelled")


def task_row(task: Task) -> dict[str, Any]:
    """The fields of a task the board shows."""
    return {
        "id": task.id,
        "kind": task.kind,
        "state": task.state,
        "model": task.model,
        "response_id": task.response_id,
        "on_restart": task.on_restart,
        "created_at": task.created_at,
        "updated_at": task.updated_at,
        "finished_at": task.finished_at,
        "last_sequence_number": task.last_sequence_number,
        "attempts": task.attempts,
        "error_code": (task.error or {}).get("code"),
    }


class TaskTable(anywidget.AnyWidget):
    """The table part of a TaskBoard (its view is `static/board.js`)."""

    _esm = _read("board.js")
    _css = _read("widgets.css")

    rows = traitlets.List(traitlets.Dict()).tag(sync=True)
    # "" for every task, else comma-separated states.
    state_filter = traitlets.Unicode("").tag(sync=True)
    selected = traitlets.Unicode("").tag(sync=True)
    connection = traitlets.Unicode("connecting").tag(sync=True)
    # Rows shown at once; the view pages through the rest.
    page_size = traitlets.Int(25, min=1).tag(sync=True)

    @traitlets.validate("state_filter")
    def _valid_filter(self, proposal: dict[str, Any]) -> str:
        states = [s.strip() for s in proposal["value"].split(",") if s.strip()]
        unknown = [s for s in states if s not in STATES]
        if unknown:
            raise traitlets.TraitError(f"unknown task state(s): {', '.join(unknown)}")
        return ",".join(states)


class TaskBoard(ipywidgets.VBox):
    """All tasks, live (the lifecycle stream; else polled every `interval` seconds); `state`
    filters ("running", a list, …)."""

    def __init__(
        self,
        client: Client | None = None,
        *,
        state: str | list[str] | None = None,
        interval: float = 1.0,
        max_rows: int = 200,
        page_size: int = 25,
        start: bool = True,
        **kwargs: Any,
    ) -> None:
        self.client = client or default_client()
        self.interval = interval
        self.max_rows = max_rows
        self.table = TaskTable(page_size=page_size)
        self.detail = ipywidgets.VBox()
        super().__init__(children=[self.table, self.detail], **kwargs)
        self.watcher: TaskWatcher | None = None
        self.tasks: list[Task] = []
        self.polls = 0
        # Numbers of the last poll started and of the latest one finished (see wait_for_poll).
        self._started = 0
        self._completed = 0
        self._stopped = threading.Event()
        self._wake = threading.Event()
        self._polled = threading.Condition()
        self._thread: threading.Thread | None = None
        # "lifecycle" while the stream is open, else "poll"; the stream, to close it.
        self.mode = "poll"
        self._stream: Any = None
        self._cursor: int | None = None
        self._rows_lock = threading.Lock()
        if state:
            self.state_filter = state if isinstance(state, str) else ",".join(state)
        self.table.on_msg(self._on_frontend_msg)
        self.table.observe(lambda _change: self._filter_changed(), names="state_filter")
        if start:
            self.start()

    def __repr__(self) -> str:
        return f"TaskBoard({len(self.tasks)} tasks, state_filter={self.state_filter!r})"

    @property
    def state_filter(self) -> str:
        return self.table.state_filter

    @state_filter.setter
    def state_filter(self, value: str | list[str]) -> None:
        self.table.state_filter = value if isinstance(value, str) else ",".join(value)

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="lmsp-board", daemon=True)
            self._thread.start()

    def refresh(self) -> list[Task]:
        """Read the task list now (the thread does this every `interval` seconds)."""
        with self._polled:
            self._started += 1
            number = self._started
        states = [s for s in self.table.state_filter.split(",") if s]
        try:
            tasks = self.client.tasks(states or None, limit=self.max_rows)
        except Exception as exc:
            self.table.connection = f"unreachable: {type(exc).__name__}"
            raise
        with self._rows_lock:
            self._show(tasks)
        with self._polled:
            self.polls += 1
            self._completed = max(self._completed, number)
            self._polled.notify_all()
        return tasks

    def _show(self, tasks: list[Task]) -> None:
        self.tasks = tasks
        rows = [task_row(t) for t in tasks]
        with self.table.hold_sync():
            if rows != self.table.rows:
                self.table.rows = rows
            self.table.connection = "live"

    def _apply(self, event: dict[str, Any]) -> None:
        """A transition from the lifecycle stream: read that task again and place it."""
        try:
            task = self.client.get_task(str(event["task_id"]))
        except Exception:
            return  # gone (deleted) meanwhile, or unreachable: the next list shows it
        states = [s for s in self.table.state_filter.split(",") if s]
        with self._rows_lock:
            tasks = [t for t in self.tasks if t.id != task.id]
            if not states or task.state in states:
                tasks.append(task)
            tasks.sort(key=lambda t: (t.created_at, t.id), reverse=True)
            self._show(tasks[: self.max_rows])

    def _filter_changed(self) -> None:
        if self.mode == "lifecycle":
            # The stream goes on; the list under the new filter is read once, off this thread.
            threading.Thread(target=self._refresh_quietly, daemon=True).start()
        else:
            self._wake.set()

    def _refresh_quietly(self) -> None:
        with contextlib.suppress(Exception):
            self.refresh()

    def wait_for_poll(self, timeout: float = 10.0) -> None:
        """Block until a poll that started after this call has finished, so that it saw every
        change made before it (a new filter, new tasks). For scripts and tests."""
        if self.mode == "lifecycle":
            self.refresh()  # nothing polls while the stream is open: list now
            return
        with self._polled:
            target = self._started + 1
            self._wake.set()
            if not self._polled.wait_for(lambda: self._completed >= target, timeout):
                raise TimeoutError("the task board did not refresh")

    def open_task(self, task_id: str) -> TaskWatcher:
        """Show a TaskWatcher for `task_id` under the table (replacing the one shown)."""
        if self.watcher is not None:
            self.watcher.close()
        self.watcher = TaskWatcher(task_id, client=self.client)
        self.detail.children = [self.watcher]
        self.table.selected = task_id
        return self.watcher

    def close(self) -> None:
        # ipywidgets may call close() from __del__ of a half-made widget: check what exists.
        if hasattr(self, "_stopped"):
            self._stopped.set()
            self._wake.set()
            stream = self._stream
            if stream is not None:
                with contextlib.suppress(Exception):
                    stream.close()
        watcher: TaskWatcher | None = getattr(self, "watcher", None)
        if watcher is not None:
            watcher.close()
        if hasattr(self, "table"):
            self.table.close()
        super().close()

    def _run(self) -> None:
        while not self._stopped.is_set():
            if self._follow_lifecycle():
                # The stream ended: open it again (from where it stopped), not in a tight
                # loop if the service keeps closing it.
                self._wake.wait(min(self.interval, 1.0))
                self._wake.clear()
                continue
            # A failure shows in the table's status; the next poll tries again.
            with contextlib.suppress(Exception):
                self.refresh()
            self._wake.wait(self.interval)
            self._wake.clear()

    def _follow_lifecycle(self) -> bool:
        """Follow the lifecycle stream until it ends; False if it could not be opened."""
        opener = getattr(self.client, "lifecycle", None)
        if opener is None:
            return False
        try:
            self._stream = opener(self._cursor)
        except Exception:
            return False
        try:
            if self._stopped.is_set():
                return True
            self.mode = "lifecycle"
            if self._cursor is None:
                self.refresh()  # where every task stands; transitions from now on follow
            for event in self._stream:
                if self._stopped.is_set():
                    break
                self._cursor = int(event["sequence_number"])
                self._apply(event)
            return True
        except Exception:
            return False
        finally:
            self.mode = "poll"
            with contextlib.suppress(Exception):
                self._stream.close()
            self._stream = None

    def _on_frontend_msg(self, _widget: Any, content: dict[str, Any], _buffers: Any) -> None:
        if content.get("type") == "open" and content.get("task_id"):
            self.open_task(str(content["task_id"]))
