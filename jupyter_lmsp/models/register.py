"""Preparing a model for registration, run as its own process by the task runner:

    python -m jupyter_lmsp.models.register SOURCE --model-dir DIR --id ID [--task-id T]
        [--max-bytes N] [--allowed FOLDER ...]

It resolves the source (with `--allowed`, only inside those folders: a paired client's
request), downloads an `hf://` source into the Hugging Face cache (see `hub`), converts a GGUF
file into DIR/ID, checks and hashes every file (see `digests.model_files`; a download's files
also against the hub's hashes), and writes JSON lines on stdout: `{"progress": {"stage",
"fraction", ...}}` while working, then one `{"model": {...}}` or `{"error": {"code",
"message"}}`. A process of its own keeps downloading, conversion and hashing off the server's
event loop, and a crash in it cannot take the server down; it dies with the server (so a
restarted server's retry is the only one running). A conversion it made is removed again if
the model is then refused.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import hub, managed
from .digests import DEFAULT_MAX_BYTES, file_digests, model_digest
from .errors import RegistrationError
from .gguf import GGUFConversionError
from .sources import Allowed, hf_cache_dir, materialize, resolve_source

_PR_SET_PDEATHSIG = 1


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _die_with_parent() -> None:
    """Ask Linux to kill this process when the server dies (kill -9 included): a download
    left running would race the one the restarted server takes up."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: a write to the closed pipe ends it instead


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
    shown_source = args.source
    _die_with_parent()
    try:
        source = resolve_source(args.source, allowed)
        fetched: list[hub.HubFile] | None = None
        if source.kind == "hf_download":
            assert source.repo is not None and source.revision is not None
            path, fetched, commit = hub.download(
                source.repo,
                source.revision,
                hf_cache_dir(),
                lambda p: _emit({"progress": p}),
                max_bytes=args.max_bytes,
            )
            # Recorded at the commit it was fetched at, so the model says what it is.
            shown_source = f"hf://{source.repo}@{commit}"
        else:
            path = materialize(source, Path(args.model_dir), args.id, progress, args.task_id)
        if source.kind == "gguf":
            made = path
        files = file_digests(
            path,
            lambda f: progress("hashing", f),
            root=source.root if source.kind != "gguf" else path,
            max_bytes=args.max_bytes,
        )
        if fetched is not None:
            hub.verify(path, fetched, {f["path"]: f["sha256"] for f in files})
    except (RegistrationError, GGUFConversionError) as e:
        if made is not None:
            managed.remove(made, args.id, Path(args.model_dir))
        code = e.code if isinstance(e, RegistrationError) else "conversion_failed"
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
                "source": (
                    shown_source if source.kind in ("hf_cache", "hf_download") else str(source.path)
                ),
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
