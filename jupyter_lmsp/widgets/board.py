"""`TaskBoard`: every task of the service, live, filterable by state; a row opens a TaskWatcher.

The service has no stream of all tasks, so a daemon thread polls `GET /tasks` (newest first,
every page up to `max_rows`, with the chosen state filter applied by the server) every
`interval` seconds and sets the table's rows. Clicking a row (or `board.open_task(task_id)`) shows a
`TaskWatcher` for it under the table.
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

    @traitlets.validate("state_filter")
    def _valid_filter(self, proposal: dict[str, Any]) -> str:
        states = [s.strip() for s in proposal["value"].split(",") if s.strip()]
        unknown = [s for s in states if s not in STATES]
        if unknown:
            raise traitlets.TraitError(f"unknown task state(s): {', '.join(unknown)}")
        return ",".join(states)


class TaskBoard(ipywidgets.VBox):
    """All tasks, refreshed every `interval` seconds; `state` filters ("running", a list, …)."""

    def __init__(
        self,
        client: Client | None = None,
        *,
        state: str | list[str] | None = None,
        interval: float = 1.0,
        max_rows: int = 200,
        start: bool = True,
        **kwargs: Any,
    ) -> None:
        self.client = client or default_client()
        self.interval = interval
        self.max_rows = max_rows
        self.table = TaskTable()
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
        if state:
            self.state_filter = state if isinstance(state, str) else ",".join(state)
        self.table.on_msg(self._on_frontend_msg)
        self.table.observe(lambda _change: self._wake.set(), names="state_filter")
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
        self.tasks = tasks
        rows = [task_row(t) for t in tasks]
        with self.table.hold_sync():
            if rows != self.table.rows:
                self.table.rows = rows
            self.table.connection = "live"
        with self._polled:
            self.polls += 1
            self._completed = max(self._completed, number)
            self._polled.notify_all()
        return tasks

    def wait_for_poll(self, timeout: float = 10.0) -> None:
        """Block until a poll that started after this call has finished, so that it saw every
        change made before it (a new filter, new tasks). For scripts and tests."""
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
        watcher: TaskWatcher | None = getattr(self, "watcher", None)
        if watcher is not None:
            watcher.close()
        if hasattr(self, "table"):
            self.table.close()
        super().close()

    def _run(self) -> None:
        while not self._stopped.is_set():
            # A failure shows in the table's status; the next poll tries again.
            with contextlib.suppress(Exception):
                self.refresh()
            self._wake.wait(self.interval)
            self._wake.clear()

    def _on_frontend_msg(self, _widget: Any, content: dict[str, Any], _buffers: Any) -> None:
        if content.get("type") == "open" and content.get("task_id"):
            self.open_task(str(content["task_id"]))
