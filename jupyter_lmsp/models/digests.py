"""Content digests of a model directory (LMSP B4), and which files a model may consist of.

Each file gets its size and sha256; the model digest is `sha256:` over the sorted list of
(name, file digest) pairs, so it changes when any file's bytes or name change, and only then.

A model's files must be safe to read and to show (docs/security.md): regular files, or links
to regular files that stay inside the model's `root` (its own folder; for a Hugging Face
cache snapshot, the repo's folder, whose `blobs/` the snapshot links to); no linked folders,
devices or pipes; at most `max_files` files and `max_bytes` in all, checked from the sizes
before a byte is read. Anything else refuses the whole model (`ModelFileError`): a link to
`/etc/shadow` must not get its size and digest listed, nor a link to a 200 GiB sparse file
keep a hashing process busy for minutes.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .errors import RegistrationError

CHUNK = 4 * 1024 * 1024
# Bookkeeping files that say nothing about the model's behaviour.
IGNORED = {"conversion.json", ".lock"}
DEFAULT_MAX_BYTES = 128 * 1024**3
DEFAULT_MAX_FILES = 10_000


class ModelFileError(RegistrationError):
    """A model directory holds something that may not be part of a model."""


def model_files(
    directory: Path,
    *,
    root: Path | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_files: int = DEFAULT_MAX_FILES,
) -> list[tuple[Path, int]]:
    """The model's files (path, size), sorted, after the checks above; dot files and
    bookkeeping files are skipped."""
    directory = Path(directory)
    inside = Path(root if root is not None else directory).resolve()
    found: list[tuple[Path, int]] = []
    total = 0

    def fail(error: OSError) -> None:
        raise ModelFileError("unreadable_model_file", f"cannot read {error.filename}") from error

    for folder, subfolders, names in os.walk(directory, followlinks=False, onerror=fail):
        here = Path(folder)
        for name in list(subfolders):
            if name.startswith("."):
                subfolders.remove(name)
            elif (here / name).is_symlink():
                raise ModelFileError(
                    "unsafe_model_file", f"'{_rel(here / name, directory)}' is a linked folder"
                )
        for name in names:
            if name in IGNORED or name.startswith("."):
                continue
            path = here / name
            size = _checked_size(path, directory, inside)
            found.append((path, size))
            total += size
            if len(found) > max_files:
                raise ModelFileError(
                    "model_too_large", f"the model has more than {max_files} files"
                )
            if total > max_bytes:
                raise ModelFileError(
                    "model_too_large", f"the model's files exceed the limit of {max_bytes} bytes"
                )
    return sorted(found)


def _checked_size(path: Path, directory: Path, inside: Path) -> int:
    """The size of a regular file, or of a link's target if it is a regular file inside."""
    try:
        st = path.lstat()
        if stat.S_ISLNK(st.st_mode):
            target = path.resolve(strict=True)
            if not target.is_relative_to(inside):
                raise ModelFileError(
                    "unsafe_model_file",
                    f"'{_rel(path, directory)}' is a link leading out of the model's folder",
                )
            st = target.stat()
    except OSError as e:
        raise ModelFileError(
            "unreadable_model_file", f"cannot read '{_rel(path, directory)}'"
        ) from e
    if not stat.S_ISREG(st.st_mode):
        raise ModelFileError(
            "unsafe_model_file", f"'{_rel(path, directory)}' is not a regular file"
        )
    return st.st_size


def _rel(path: Path, directory: Path) -> str:
    return path.relative_to(directory).as_posix()


def file_digests(
    directory: Path,
    progress: Callable[[float], None] | None = None,
    *,
    root: Path | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_files: int = DEFAULT_MAX_FILES,
) -> list[dict[str, Any]]:
    """[{"path", "size", "sha256"}] for every file, paths relative to `directory`."""
    directory = Path(directory)
    files = model_files(directory, root=root, max_bytes=max_bytes, max_files=max_files)
    total = sum(size for _, size in files) or 1
    done = 0
    out = []
    for f, size in files:
        h = hashlib.sha256()
        read = 0
        with f.open("rb") as stream:
            # Never more than the size checked above: a file that grows meanwhile is refused.
            while chunk := stream.read(min(CHUNK, size + 1 - read)):
                read += len(chunk)
                if read > size:
                    raise ModelFileError("unsafe_model_file", f"'{_rel(f, directory)}' changed")
                h.update(chunk)
                done += len(chunk)
                if progress is not None:
                    progress(done / total)
        if read != size:
            raise ModelFileError("unsafe_model_file", f"'{_rel(f, directory)}' changed")
        out.append({"path": _rel(f, directory), "size": size, "sha256": h.hexdigest()})
    return out


def model_digest(files: list[dict[str, Any]]) -> str:
    h = hashlib.sha256()
    for entry in sorted(files, key=lambda e: e["path"]):
        h.update(f"{entry['sha256']}  {entry['path']}\n".encode())
    return "sha256:" + h.hexdigest()
