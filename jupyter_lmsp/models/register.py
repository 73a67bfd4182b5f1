"""Preparing a model for registration, run as its own process by the task runner:

    python -m jupyter_lmsp.models.register SOURCE --model-dir DIR --id ID [--task-id T]
        [--max-bytes N] [--allowed FOLDER ...]

It resolves the source (with `--allowed`, only inside those folders: a paired client's
request), converts a GGUF file into DIR/ID, checks and hashes every file (see
`digests.model_files`), and writes JSON lines on stdout: `{"progress": {"stage", "fraction"}}`
while working, then one `{"model": {...}}` or `{"error": {"code", "message"}}`. A process of
its own keeps conversion and hashing off the server's event loop, and a crash in it cannot take
the server down. A conversion it made is removed again if the model is then refused.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import managed
from .digests import DEFAULT_MAX_BYTES, ModelFileError, file_digests, model_digest
from .gguf import GGUFConversionError
from .sources import Allowed, SourceError, materialize, resolve_source


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jupyter_lmsp.models.register")
    parser.add_argument("source")
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--id", required=True)
    parser.add_argument("--task-id", default="")
    parser.add_argument("--max-bytes", type=int, default=DEFAULT_MAX_BYTES)
    parser.add_argument("--allowed", action="append", default=None)
    args = parser.parse_args(argv)
    last = [0.0]
    allowed = Allowed([Path(a) for a in args.allowed]) if args.allowed is not None else None

    def progress(stage: str, fraction: float) -> None:
        now = time.monotonic()
        if now - last[0] >= 0.2 or fraction >= 1.0:
            last[0] = now
            _emit({"progress": {"stage": stage, "fraction": round(fraction, 4)}})

    made: Path | None = None
    try:
        source = resolve_source(args.source, allowed)
        path = materialize(source, Path(args.model_dir), args.id, progress, args.task_id)
        if source.kind == "gguf":
            made = path
        files = file_digests(
            path,
            lambda f: progress("hashing", f),
            root=source.root if source.kind != "gguf" else path,
            max_bytes=args.max_bytes,
        )
    except (SourceError, ModelFileError, GGUFConversionError) as e:
        if made is not None:
            managed.remove(made, args.id, Path(args.model_dir))
        code = e.code if isinstance(e, SourceError | ModelFileError) else "conversion_failed"
        _emit({"error": {"code": code, "message": str(e)}})
        return 1
    except BaseException:
        if made is not None:
            managed.remove(made, args.id, Path(args.model_dir))
        raise
    _emit(
        {
            "model": {
                "id": args.id,
                "format": "mlx",
                "path": str(path),
                # A repo id as given; a path as resolved (never relative to some folder).
                "source": args.source if source.kind == "hf_cache" else str(source.path),
                "source_kind": source.kind,
                "managed": made is not None,
                "files": files,
                "size_bytes": sum(f["size"] for f in files),
                "digest": model_digest(files),
            }
        }
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
