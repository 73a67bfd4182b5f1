"""A `jupyter server` subprocess set up for the openai SDK tests: its own data folder with the
tiny test model linked in as `tiny` (the default model), started and stopped as a context.

Extra keyword arguments become `LMSPExtension` traits (see `serverproc.ServerProcess`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from serverproc import TOKEN, ServerProcess

MODEL = "tiny"

__all__ = ["MODEL", "TOKEN", "sdk_server"]


@contextmanager
def sdk_server(data_dir: Path, model_dir: Path, **traits: Any) -> Iterator[ServerProcess]:
    """A running server whose only model, `tiny`, is the test model at `model_dir`."""
    (data_dir / "models").mkdir(parents=True, exist_ok=True)
    (data_dir / "models" / MODEL).symlink_to(model_dir)
    server = ServerProcess(data_dir, default_model=MODEL, **traits)
    server.start()
    try:
        yield server
    finally:
        server.stop()
