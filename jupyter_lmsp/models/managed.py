"""Model directories the service made itself, and the only ones it ever deletes.

A GGUF conversion is written into the model folder with a marker file (`.lmsp-managed`, JSON
naming the model id and the registration task); its `models` row is recorded `managed`.
Deleting a model removes its directory only when both say so and the directory is a real
folder directly inside the model folder: the row alone (a database edited by hand, a path
changed under it) or the marker alone (anyone can write a file) is not enough.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path
from typing import Any

MARKER = ".lmsp-managed"


def marker_content(model_id: str, task_id: str) -> dict[str, Any]:
    return {"created_by": "jupyter-lmsp", "model_id": model_id, "task_id": task_id}


def read_marker(directory: Path) -> dict[str, Any] | None:
    """The marker of `directory`, if it has one that is a regular file (not a link)."""
    path = Path(directory) / MARKER
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(4096)
    finally:
        os.close(fd)
    try:
        value = json.loads(data)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def owns(directory: Path, model_id: str, model_dir: Path) -> bool:
    """Whether `directory` is a folder the service made for `model_id`: a real directory (no
    link) directly inside `model_dir`, holding this service's marker for that model."""
    directory = Path(directory)
    try:
        st = directory.lstat()
    except OSError:
        return False
    if not stat.S_ISDIR(st.st_mode):
        return False
    if directory.parent.resolve() != Path(model_dir).resolve():
        return False
    marker = read_marker(directory)
    return (
        marker is not None
        and marker.get("created_by") == "jupyter-lmsp"
        and marker.get("model_id") == model_id
    )


def remove(directory: Path, model_id: str, model_dir: Path) -> bool:
    """Delete `directory` if `owns` says the service made it for `model_id`; whether it did."""
    if not owns(directory, model_id, model_dir):
        return False
    shutil.rmtree(directory, ignore_errors=True)
    return True
