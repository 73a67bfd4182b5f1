"""The user's cache folder for what the engine keeps between processes: the BLAS verdicts and
the links to their libraries (`engine.blas`), transformers' index of its model folders
(`engine.transformers_index`). `$XDG_CACHE_HOME/jupyter-lmsp`, else `~/.cache/jupyter-lmsp`.
Imports nothing of the package: `jupyter_lmsp.engine` uses it as it is imported."""

from __future__ import annotations

import os
from pathlib import Path


def user_cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "jupyter-lmsp"
