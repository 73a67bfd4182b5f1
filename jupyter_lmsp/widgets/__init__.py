"""Notebook widgets for the LMSP service: `TaskWatcher` (one task, live) and `TaskBoard` (every
task, live, filterable by state). Both are anywidgets whose ES modules ship in this package
(`static/`), so they need no build step and load nothing from a CDN.

A response or task object (`jupyter_lmsp.client.Response`, `Task`) left as the last expression
of a cell renders as a `TaskWatcher`: importing this package registers it with the client
(`jupyter_lmsp.client.display`), which finds it through the `jupyter_lmsp.watchers` entry point.
"""

from __future__ import annotations

from ..client.display import register_watcher
from .board import TaskBoard, TaskTable
from .state import WatcherState
from .watcher import TaskWatcher

register_watcher(TaskWatcher)

__all__ = ["TaskBoard", "TaskTable", "TaskWatcher", "WatcherState"]
