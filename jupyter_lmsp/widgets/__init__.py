"""Notebook widgets for the LMSP service: `TaskWatcher` (one task, live) and `TaskBoard` (every
task, live, filterable by state). Both are anywidgets whose ES modules ship in this package
(`static/`), so they need no build step and load nothing from a CDN.

A response or task object (`jupyter_lmsp.client.Response`, `Task`) left as the last expression
of a cell renders as a `TaskWatcher`.
"""

from __future__ import annotations

from .board import TaskBoard, TaskTable
from .state import WatcherState
from .watcher import TaskWatcher

__all__ = ["TaskBoard", "TaskTable", "TaskWatcher", "WatcherState"]
