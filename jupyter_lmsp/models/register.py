"""Preparing a model for registration, run as its own process by the task runner:

    python -m jupyter_lmsp.models.register SOURCE --model-dir DIR --id ID

It resolves the source, converts a GGUF file into DIR/ID, hashes every file, and writes JSON
lines on stdout: `{"progress": {"stage", "fraction"}}` while working, then one
`{"model": {...}}` or `{"error": {"code", "message"}}`. A process of its own keeps conversion
and hashing off the server's event loop, and a crash in it cannot take the server down.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from .digests import file_digests, model_digest
from .gguf import GGUFConversionError
from .sources import SourceError, materialize, resolve_source


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jupyter_lmsp.models.register")
    parser.add_argument("source")
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--id", required=True)
    args = parser.parse_args(argv)
    last = [0.0]

    def progress(stage: str, fraction: float) -> None:
        now = time.monotonic()
        if now - last[0] >= 0.2 or fraction >= 1.0:
            last[0] = now
            _emit({"progress": {"stage": stage, "fraction": round(fraction, 4)}})

    try:
        source = resolve_source(args.source)
        path = materialize(source, args.model_dir, args.id, progress)
        files = file_digests(path, lambda f: progress("hashing", f))
    except SourceError as e:
        _emit({"error": {"code": e.code, "message": e.message}})
        return 1
    except GGUFConversionError as e:
        _emit({"error": {"code": "conversion_failed", "message": str(e)}})
        return 1
    _emit(
        {
            "model": {
                "id": args.id,
                "format": "mlx",
                "path": str(path),
                "source": args.source,
                "source_kind": source.kind,
                "files": files,
                "size_bytes": sum(f["size"] for f in files),
                "digest": model_digest(files),
            }
        }
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
