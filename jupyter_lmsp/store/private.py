"""File modes that keep the service's state from other local users (docs/security.md).

The data folder is 0700 and the database with its `-wal`, `-shm` and `-journal` companions
0600, also when they already exist with wider modes (earlier releases left them 0755 / 0644).
SQLite gives the files it creates beside a database the database file's own mode, so making
the database file 0600 before the first connection covers the WAL and shared-memory files too.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

FOLDER_MODE = 0o700
FILE_MODE = 0o600
DATABASE_SUFFIXES = ("", "-wal", "-shm", "-journal")


def private_folder(path: str | os.PathLike[str]) -> Path:
    """Create `path` (and its parents) if missing, and make `path` itself 0700 if we own it."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True, mode=FOLDER_MODE)
    _restrict(folder, FOLDER_MODE)
    return folder


def private_database(path: str | os.PathLike[str]) -> None:
    """Create the database file 0600 if missing; make it and its companions 0600."""
    db = Path(path)
    db.parent.mkdir(parents=True, exist_ok=True, mode=FOLDER_MODE)
    # O_CREAT with a mode: the file never exists with the umask's wider mode, not even briefly.
    with contextlib.suppress(FileExistsError):
        os.close(os.open(db, os.O_CREAT | os.O_EXCL | os.O_WRONLY, FILE_MODE))
    for suffix in DATABASE_SUFFIXES:
        _restrict(Path(f"{db}{suffix}"), FILE_MODE)


def _restrict(path: Path, mode: int) -> None:
    try:
        st = path.lstat()
    except FileNotFoundError:
        return
    # Never through a symbolic link, and only what this user owns (chmod would fail anyway).
    if stat.S_ISLNK(st.st_mode) or (hasattr(os, "getuid") and st.st_uid != os.getuid()):
        return
    if stat.S_IMODE(st.st_mode) != mode:
        os.chmod(path, mode)
