"""Content digests of a model directory (LMSP B4).

Each file gets its size and sha256; the model digest is `sha256:` over the sorted list of
(name, file digest) pairs, so it changes when any file's bytes or name change, and only then.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

CHUNK = 4 * 1024 * 1024
# Bookkeeping files that say nothing about the model's behaviour.
IGNORED = {"conversion.json", ".lock"}


def model_files(directory: Path) -> list[Path]:
    return sorted(
        p
        for p in Path(directory).rglob("*")
        if p.is_file() and p.name not in IGNORED and not p.name.startswith(".")
    )


def file_digests(
    directory: Path, progress: Callable[[float], None] | None = None
) -> list[dict[str, Any]]:
    """[{"path", "size", "sha256"}] for every file, paths relative to `directory`."""
    directory = Path(directory)
    files = model_files(directory)
    total = sum(f.stat().st_size for f in files) or 1
    done = 0
    out = []
    for f in files:
        h = hashlib.sha256()
        with f.open("rb") as stream:
            while chunk := stream.read(CHUNK):
                h.update(chunk)
                done += len(chunk)
                if progress is not None:
                    progress(done / total)
        out.append(
            {
                "path": f.relative_to(directory).as_posix(),
                "size": f.stat().st_size,
                "sha256": h.hexdigest(),
            }
        )
    return out


def model_digest(files: list[dict[str, Any]]) -> str:
    h = hashlib.sha256()
    for entry in sorted(files, key=lambda e: e["path"]):
        h.update(f"{entry['sha256']}  {entry['path']}\n".encode())
    return "sha256:" + h.hexdigest()


def verify(directory: Path, files: list[dict[str, Any]]) -> list[str]:
    """The paths whose bytes no longer match their recorded digest (or are missing)."""
    current = {e["path"]: e for e in file_digests(directory)}
    return [
        e["path"]
        for e in files
        if e["path"] not in current or current[e["path"]]["sha256"] != e["sha256"]
    ]
