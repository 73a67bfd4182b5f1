"""jupyter-lmsp: a Jupyter Server extension that serves LMSP 1.0, a local language-model service
with durable tasks, on MLX.

The extension point below is what `jupyter server` loads; `extension.LMSPExtension` is the app.
"""

from __future__ import annotations

from typing import Any

from ._version import __version__

__all__ = ["__version__"]


def _jupyter_labextension_paths() -> list[dict[str, str]]:
    """The prebuilt JupyterLab sidebar (built from labextension/ into jupyter_lmsp/labextension),
    for `jupyter labextension develop .`."""
    return [{"src": "labextension", "dest": "jupyter-lmsp-labextension"}]


def _jupyter_server_extension_points() -> list[dict[str, Any]]:
    from .extension import LMSPExtension

    return [{"module": "jupyter_lmsp", "app": LMSPExtension}]
