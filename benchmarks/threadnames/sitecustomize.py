"""Benchmarks only (`bench_pipeline.py` puts this folder on a server's PYTHONPATH): each Python
thread gives its name to its OS thread, so /proc/<pid>/task/<tid>/comm tells the server's
threads apart (the event loop is `MainThread`) and their CPU time can be read one by one.
Python 3.11 leaves every thread with the process's name; Linux keeps 15 characters."""

from __future__ import annotations

import ctypes
import threading

_PR_SET_NAME = 15
_original_bootstrap = threading.Thread._bootstrap_inner  # type: ignore[attr-defined]


def _set_name(name: str) -> None:
    try:
        libc = ctypes.CDLL(None)
        libc.prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except Exception:
        pass


def _named_bootstrap(self: threading.Thread) -> None:
    _set_name(self.name)
    _original_bootstrap(self)


threading.Thread._bootstrap_inner = _named_bootstrap  # type: ignore[attr-defined]
if threading.current_thread() is threading.main_thread():
    _set_name("MainThread")
