"""Checking a registered model's files before they are loaded (LMSP B4, docs/security.md).

Only the files recorded at registration are read, and each only after `fstat` says it is a
regular file of exactly the recorded size: an extra file, a file that changed size, a link to
a 200 GiB sparse file, a pipe or a device refuses the model at once, without reading a byte.
A file whose hash was already checked is not read again while its identity — device, inode,
size, modification and change times — is the same: the change time cannot be set by any
program, so a file rewritten in place has a new identity. Hashing checks a cancel event
between chunks, so a cancel stops it within one chunk.

`Verifier.check` returns the identities it verified; `Verifier.changed` tells which files no
longer have them. Checking again after loading closes the gap between verifying and loading:
the bytes loaded are the bytes verified unless a file changed identity, and then the load is
thrown away.
"""

from __future__ import annotations

import hashlib
import os
import stat
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .digests import IGNORED

CHUNK = 4 * 1024 * 1024
# Verdicts remembered (one per file), least recently used forgotten first.
MAX_VERDICTS = 4096


@dataclass(frozen=True)
class Identity:
    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> Identity:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class Mismatch(Exception):
    """The model's files are not the ones registered (`model_digest_mismatch`)."""

    code = "model_digest_mismatch"

    def __init__(self, message: str, paths: list[str]) -> None:
        super().__init__(message)
        self.message = message
        self.paths = paths


class Cancelled(Exception):
    """Verification stopped because its cancel event was set."""


class Verifier:
    def __init__(self, max_verdicts: int = MAX_VERDICTS) -> None:
        self._verdicts: OrderedDict[str, tuple[Identity, str]] = OrderedDict()
        self._max = max_verdicts
        self._lock = threading.Lock()
        # Bytes read for hashing, for tests and logs: a cached verdict reads nothing.
        self.bytes_hashed = 0

    def check(
        self,
        directory: Path,
        files: list[dict[str, Any]],
        cancel: threading.Event | None = None,
    ) -> dict[str, Identity]:
        """Verify `directory` against the recorded `files` ([{"path", "size", "sha256"}]);
        raise `Mismatch` or `Cancelled`, else return each file's verified identity."""
        directory = Path(directory)
        recorded = {f["path"]: f for f in files}
        extra = _unexpected(directory, set(recorded))
        if extra:
            raise Mismatch(
                f"{len(extra)} file(s) in the model's folder were not registered: "
                + ", ".join(extra[:5]),
                extra,
            )
        # Every file's type and size first, from `stat` alone: a model with any file that is
        # obviously wrong is refused before a byte of it is read.
        bad: list[str] = []
        reasons: list[str] = []
        for name in sorted(recorded):
            try:
                _expect(os.stat(directory / name), recorded[name])
            except FileNotFoundError:
                bad.append(name)
                reasons.append(f"{name} (missing)")
            except (OSError, _Bad) as e:
                bad.append(name)
                reasons.append(f"{name} ({_reason(e)})")
        identities: dict[str, Identity] = {}
        if not bad:
            for name in sorted(recorded):
                try:
                    identities[name] = self._check_file(directory / name, recorded[name], cancel)
                except _Bad as e:
                    bad.append(name)
                    reasons.append(f"{name} ({e})")
        if bad:
            raise Mismatch(
                f"{len(bad)} file(s) of the model no longer match their digests: "
                + ", ".join(reasons[:5]),
                bad,
            )
        return identities

    def changed(self, directory: Path, identities: dict[str, Identity]) -> list[str]:
        """The files whose identity differs from the one verified (or that are gone)."""
        out = []
        for name, identity in identities.items():
            try:
                now = Identity.of(os.stat(Path(directory) / name))
            except OSError:
                out.append(name)
                continue
            if now != identity:
                out.append(name)
        return out

    def _check_file(
        self, path: Path, entry: dict[str, Any], cancel: threading.Event | None
    ) -> Identity:
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        except FileNotFoundError:
            raise _Bad("missing") from None
        except OSError as e:
            raise _Bad(e.strerror or "unreadable") from None
        try:
            st = os.fstat(fd)
            _expect(st, entry)
            identity = Identity.of(st)
            key = str(path)
            with self._lock:
                cached = self._verdicts.get(key)
                if cached is not None:
                    self._verdicts.move_to_end(key)
            if cached == (identity, entry["sha256"]):
                return identity
            digest = self._hash(fd, entry["size"], cancel)
            if digest != entry["sha256"]:
                raise _Bad("different bytes")
            # The file may have changed while it was read: remember the verdict only for the
            # identity it still has (a different one is checked again next time).
            if Identity.of(os.fstat(fd)) != identity:
                raise _Bad("changed while it was read")
            with self._lock:
                self._verdicts[key] = (identity, digest)
                while len(self._verdicts) > self._max:
                    self._verdicts.popitem(last=False)
            return identity
        finally:
            os.close(fd)

    def _hash(self, fd: int, size: int, cancel: threading.Event | None) -> str:
        h = hashlib.sha256()
        read = 0
        while read <= size:
            if cancel is not None and cancel.is_set():
                raise Cancelled
            chunk = os.read(fd, min(CHUNK, size + 1 - read))
            if not chunk:
                break
            read += len(chunk)
            h.update(chunk)
        self.bytes_hashed += read
        if read != size:
            raise _Bad("changed while it was read")
        return h.hexdigest()


class _Bad(Exception):
    pass


def _expect(st: os.stat_result, entry: dict[str, Any]) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise _Bad("not a regular file")
    if st.st_size != entry["size"]:
        raise _Bad(f"{st.st_size} bytes, registered {entry['size']}")


def _reason(e: Exception) -> str:
    return (e.strerror or "unreadable") if isinstance(e, OSError) else str(e)


def _unexpected(directory: Path, recorded: set[str], limit: int = 20) -> list[str]:
    """Files (and linked folders) in `directory` that are not `recorded`, up to `limit`.
    Dot files and bookkeeping files do not count; nothing is followed or read."""
    extra: list[str] = []
    for folder, subfolders, names in os.walk(directory, followlinks=False):
        here = Path(folder)
        for name in list(subfolders):
            if name.startswith("."):
                subfolders.remove(name)
            elif (here / name).is_symlink():
                extra.append((here / name).relative_to(directory).as_posix() + "/")
        for name in names:
            if name in IGNORED or name.startswith("."):
                continue
            rel = (here / name).relative_to(directory).as_posix()
            if rel not in recorded:
                extra.append(rel)
        if len(extra) >= limit:
            break
    return sorted(extra)
