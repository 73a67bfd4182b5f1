"""jupyter-lmsp: a Jupyter Server extension that serves LMSP 1.0, a local language-model service
with durable tasks, on MLX.

The extension point below is what `jupyter server` loads; `extension.LMSPExtension` is the app.
"""

from __future__ import annotations

import gc
from typing import Any

from ._version import __version__

__all__ = ["__version__"]


def _jupyter_labextension_paths() -> list[dict[str, str]]:
    """The prebuilt JupyterLab sidebar (built from labextension/ into jupyter_lmsp/labextension),
    for `jupyter labextension develop .`."""
    return [{"src": "labextension", "dest": "jupyter-lmsp-labextension"}]


def _jupyter_server_extension_points() -> list[dict[str, Any]]:
    # The extension's modules are imported with the garbage collector paused: what they make
    # (pydantic models, tables, statements) lives as long as the server, and each collection
    # during the import scanned Jupyter Server's objects again: 0.1 of the 0.5 s of CPU the
    # import takes here. The server freezes its start-up heap out of later scans anyway
    # (`LMSPExtension.freeze_startup_heap`).
    enabled = gc.isenabled()
    gc.disable()
    try:
        from .extension import LMSPExtension
    finally:
        if enabled:
            gc.enable()

    return [{"module": "jupyter_lmsp", "app": LMSPExtension}]
