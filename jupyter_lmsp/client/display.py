"""How responses and tasks show in a notebook: as a live watcher, which the widgets provide.

The client knows nothing of widgets (they depend on it, not the reverse). `jupyter_lmsp.widgets`
registers its `TaskWatcher` here when it is imported, and announces itself through the entry
point group `jupyter_lmsp.watchers` (pyproject.toml), which the client loads the first time it
needs a watcher: a response left as the last expression of a cell renders live without the
user importing the widgets.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

ENTRY_POINT_GROUP = "jupyter_lmsp.watchers"

# (object, client=…, **kwargs) → a widget showing the object's task live.
WatcherFactory = Callable[..., Any]

_factory: WatcherFactory | None = None
_loaded_entry_points = False


def register_watcher(factory: WatcherFactory) -> None:
    """Make `factory` the way responses and tasks are watched and displayed."""
    global _factory
    _factory = factory


def watcher_factory() -> WatcherFactory | None:
    """The registered watcher, loading the `jupyter_lmsp.watchers` entry points once."""
    global _loaded_entry_points
    if _factory is None and not _loaded_entry_points:
        _loaded_entry_points = True
        for entry in entry_points(group=ENTRY_POINT_GROUP):
            entry.load()  # importing the module registers its watcher
    return _factory
