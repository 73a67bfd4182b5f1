"""Downloading a model from a Hugging Face hub (issue 39): the `hf://ORG/NAME[@REVISION]`
source of `POST /models`.

The files go through `huggingface_hub` into the user's Hugging Face cache (`HF_HUB_CACHE`, or
`HF_HOME/hub`), laid out as every other tool expects (`blobs/<etag>`, `snapshots/<commit>/` links,
`refs/<revision>`), so they are shared. The revision is resolved to a commit first and every file
is fetched at that commit, so a branch moving during the download cannot mix two versions.

Resuming is ours: `hf_hub_download` (huggingface_hub 2.x, PR #4228) downloads into a file named
for the process (`<etag>.<random>.incomplete`) and always from byte 0, so what a killed process
left is never reused. Here each file is fetched with huggingface_hub's own pieces (the HEAD that
names the etag and size, `http_get` with its retries and `Range: bytes=N-`) into the stable
`blobs/<etag>.incomplete` the older clients used, under the same lock file `hf_hub_download`
takes (`.locks/<repo folder>/<etag>.lock`), then moved to `blobs/<etag>` and linked from the
snapshot. A download taken up again after a crash (the registration task is retried at
start-up) fetches only the bytes it lacks, and a blob already in the cache is not fetched.

`huggingface_hub` does not check what it received against the hashes the hub publishes; this
module does (`verify`): the sha256 of an LFS file, the git blob id (sha1 of `blob <size>\\0` +
bytes) of any other. A file that does not match is removed from the cache (blob and snapshot
link), so neither a retry nor another tool reuses it, and the download fails
(`download_corrupt`).

Progress comes from the progress-bar class `huggingface_hub` accepts (`tqdm_class`): it is told
each chunk it writes (10 MiB reads in huggingface_hub 2.x), which is what `DownloadProgress` counts.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .digests import CHUNK
from .errors import RegistrationError

# A Hugging Face repo id (`ORG/NAME`), and an `hf://` source (with a revision or not).
REPO_ID = r"[A-Za-z0-9][\w.\-]*/[\w.\-]+"
HF_SOURCE = re.compile(rf"^hf://({REPO_ID})(?:@([\w.\-/]+))?$")
DEFAULT_REVISION = "main"


class DownloadError(RegistrationError):
    """A download that could not be done, or whose bytes are not what the hub published."""


@dataclass
class HubFile:
    """A file of the repo at the commit, as the hub describes it."""

    path: str
    size: int
    sha256: str | None  # an LFS file's sha256
    blob_id: str | None  # the git blob id (sha1) of a file stored in git


def parse(source: str) -> tuple[str, str] | None:
    """(repo id, revision) of an `hf://` source; None when `source` is not one."""
    m = HF_SOURCE.match(source)
    if m is None:
        return None
    return m.group(1), m.group(2) or DEFAULT_REVISION


def repo_folder(cache: Path, repo_id: str) -> Path:
    return Path(cache) / f"models--{repo_id.replace('/', '--')}"


Report = Callable[[dict[str, Any]], None]


class DownloadProgress:
    """Bytes and files done of one download, told to `report` (a dict of the progress fields)
    at most every `every` seconds, and at each file's end. Bytes count per file, so what an
    earlier attempt left on disk counts from the first report on."""

    def __init__(self, files: list[HubFile], report: Report, every: float = 0.5) -> None:
        self.sizes = {f.path: f.size for f in files}
        self.bytes_total = sum(self.sizes.values())
        self.files_total = len(files)
        self.done: dict[str, int] = {}  # bytes on disk, by file
        self.finished: set[str] = set()
        self.current = ""
        self.report = report
        self.every = every
        self.started = time.monotonic()
        self.fetched = 0  # bytes received by this process (for the rate)
        self.last = 0.0

    def found(self, path: str, size: int, complete: bool) -> None:
        """What an earlier attempt left: a whole file, or `size` bytes of one."""
        self.done[path] = size
        if complete:
            self.finished.add(path)

    def bar_class(self, path: str) -> Callable[..., Any]:
        """What to pass as `tqdm_class` for `path`: a plain class (not a tqdm) huggingface_hub
        builds with the progress bar's keyword arguments and tells each chunk."""
        tracker = self

        class Bar:
            def __init__(self, **kwargs: Any) -> None:
                tracker.done[path] = int(kwargs.get("initial") or 0)

            def update(self, n: int) -> None:
                # Negative when the server ignored a Range and the file starts over.
                tracker.done[path] = tracker.done.get(path, 0) + n
                if n > 0:
                    tracker.fetched += n
                tracker.emit()

            def __enter__(self) -> Bar:
                return self

            def __exit__(self, *exc: object) -> None:
                return None

        return Bar

    def file_done(self, path: str) -> None:
        self.finished.add(path)
        self.done[path] = self.sizes[path]
        self.emit(force=True)

    def emit(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.last < self.every:
            return
        self.last = now
        done = min(sum(self.done.values()), self.bytes_total)
        elapsed = max(now - self.started, 1e-6)
        self.report(
            {
                "stage": "downloading",
                "fraction": round(done / self.bytes_total, 4) if self.bytes_total else 1.0,
                "bytes_done": done,
                "bytes_total": self.bytes_total,
                "files_done": len(self.finished),
                "files_total": self.files_total,
                "bytes_per_second": round(self.fetched / elapsed, 1),
            }
        )


def _fetch(repo_id: str, commit: str, f: HubFile, cache: Path, progress: DownloadProgress) -> None:
    """One file into the cache at `commit`, resuming its partial blob."""
    from filelock import FileLock
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    folder = repo_folder(cache, repo_id)
    pointer = folder / "snapshots" / commit / f.path
    if pointer.is_file():
        return
    meta = get_hf_file_metadata(hf_hub_url(repo_id, f.path, revision=commit))
    etag = meta.etag
    if not etag or "/" in etag or etag.startswith("."):
        raise DownloadError("download_failed", f"The hub named no usable etag for '{f.path}'.")
    blob = folder / "blobs" / etag
    blob.parent.mkdir(parents=True, exist_ok=True)
    lock = cache / ".locks" / folder.name / f"{etag}.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(lock)):
        if not blob.is_file():
            part = folder / "blobs" / f"{etag}.incomplete"
            resume = part.stat().st_size if part.exists() else 0
            if meta.size is not None and resume > meta.size:
                resume = 0  # not a prefix of this file: start again
            with open(part, "r+b" if resume else "wb") as out:
                out.truncate(resume)
                out.seek(resume)
                http_get(
                    meta.location,
                    out,
                    resume_size=resume,
                    headers=build_hf_headers(),
                    expected_size=meta.size,
                    displayed_filename=f.path,
                    tqdm_class=progress.bar_class(f.path),  # type: ignore[arg-type]
                )
            os.replace(part, blob)
    pointer.parent.mkdir(parents=True, exist_ok=True)
    target = os.path.relpath(blob, pointer.parent)
    if pointer.is_symlink():
        pointer.unlink()
    try:
        pointer.symlink_to(target)
    except OSError:  # no links here (some Windows set-ups): a copy, as huggingface_hub does
        import shutil

        shutil.copyfile(blob, pointer)


def _left_on_disk(
    folder: Path, commit: str, files: list[HubFile], progress: DownloadProgress
) -> None:
    """Tell `progress` what an earlier attempt left in the cache: files of the snapshot, and
    partial blobs (`blobs/<etag>.incomplete`; the etag is an LFS file's sha256, another file's
    git blob id)."""
    for f in files:
        if (folder / "snapshots" / commit / f.path).is_file():
            progress.found(f.path, f.size, complete=True)
            continue
        etag = f.sha256 or f.blob_id
        if etag:
            partial = folder / "blobs" / f"{etag}.incomplete"
            with contextlib.suppress(OSError):
                progress.found(f.path, partial.stat().st_size, complete=False)


def download(
    repo_id: str, revision: str, cache: Path, report: Report, max_bytes: int | None = None
) -> tuple[Path, list[HubFile], str]:
    """Fetch every file of `repo_id` at `revision` into the cache `cache`; the snapshot
    folder, the hub's description of its files, and the commit. A repo larger than
    `max_bytes` (as the hub lists it) is refused before a byte is fetched."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import (
        EntryNotFoundError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        info = HfApi().model_info(repo_id, revision=revision, files_metadata=True)
    except RevisionNotFoundError:
        raise DownloadError(
            "model_not_found", f"The hub has no revision '{revision}' of '{repo_id}'."
        ) from None
    except RepositoryNotFoundError:
        raise DownloadError("model_not_found", f"The hub has no model '{repo_id}'.") from None
    except (HfHubHTTPError, OSError) as e:
        raise DownloadError(
            "download_failed", f"Asking the hub about '{repo_id}' failed: {e}"
        ) from None
    commit = info.sha
    if not commit:
        raise DownloadError("download_failed", f"The hub named no commit for '{repo_id}'.")
    files = [
        HubFile(
            s.rfilename,
            int(s.size or 0),
            s.lfs.sha256 if s.lfs is not None else None,
            s.blob_id,
        )
        for s in info.siblings or []
    ]
    if not any(f.path == "config.json" for f in files):
        raise DownloadError(
            "unsupported_source", f"'{repo_id}' has no config.json: not an MLX model repository."
        )
    total = sum(f.size for f in files)
    if max_bytes is not None and total > max_bytes:
        raise DownloadError(
            "model_too_large",
            f"'{repo_id}' holds {total} bytes, more than the limit of {max_bytes}.",
        )
    folder = repo_folder(cache, repo_id)
    progress = DownloadProgress(files, report)
    _left_on_disk(folder, commit, files, progress)
    progress.emit(force=True)
    for f in files:
        try:
            _fetch(repo_id, commit, f, cache, progress)
        except EntryNotFoundError:
            raise DownloadError(
                "download_failed", f"The hub listed '{f.path}' but does not serve it."
            ) from None
        except (HfHubHTTPError, OSError) as e:
            raise DownloadError("download_failed", f"Downloading '{f.path}' failed: {e}") from None
        progress.file_done(f.path)
    if revision != commit:
        # What `snapshot_download` records too: other tools find the revision by its name.
        (folder / "refs").mkdir(parents=True, exist_ok=True)
        (folder / "refs" / revision).write_text(commit)
    return folder / "snapshots" / commit, files, commit


def verify(snapshot: Path, files: list[HubFile], sha256s: dict[str, str]) -> None:
    """Check every file against the hub's hash (`sha256s`: the snapshot's digests, by path,
    as registration computed them for every file); a file that differs, or is missing, is
    removed from the cache and fails the download."""
    bad = []
    for f in files:
        path = snapshot / f.path
        if f.sha256 is not None:
            ok = sha256s.get(f.path) == f.sha256
        elif f.blob_id is not None:
            ok = _git_blob_id(path) == f.blob_id
        else:
            raise DownloadError(
                "download_corrupt",
                f"The hub published no hash for '{f.path}'; it cannot be checked.",
            )
        if not ok:
            bad.append(f.path)
            _discard(path)
    if bad:
        raise DownloadError(
            "download_corrupt",
            "The bytes received do not match the hash the hub publishes for: "
            + ", ".join(bad)
            + ". They were removed from the cache; nothing was registered.",
        )


def _discard(link: Path) -> None:
    """Remove a snapshot file and the blob it links to."""
    try:
        blob = link.resolve()
        link.unlink()
        if blob != link and blob.parent.name == "blobs":
            blob.unlink()
    except OSError:
        pass


def _git_blob_id(path: Path) -> str:
    h = hashlib.sha1(usedforsecurity=False)
    h.update(b"blob %d\0" % os.path.getsize(path))
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()
