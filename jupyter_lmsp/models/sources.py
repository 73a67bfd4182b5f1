"""Where a model comes from when it is registered (LMSP B4), and how it becomes an MLX directory.

A source is a local MLX model directory (registered where it is), a Hugging Face repo id found
in the local Hugging Face cache (never downloaded: a service must not fetch weights behind its
user's back), `hf://ORG/NAME[@REVISION]` (downloaded from the hub into that cache on purpose,
see `hub`), or a GGUF file, converted into the service's model store.

The owner may name any path. A paired client may name only what lies inside `allowed` folders
(the model folder, the Hugging Face cache, and those the owner configured): `Allowed` checks
the path as written (no `..` out of a folder) and as resolved (no link out of the entry the
owner placed there), and every refusal is the same `SourceError`, so a client cannot probe
which paths exist.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from . import hub, managed
from .errors import RegistrationError

if TYPE_CHECKING:
    from .gguf import ProgressCallback

HF_REPO = re.compile(rf"^{hub.REPO_ID}$")
MODEL_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,99}$")


class SourceError(RegistrationError):
    """A source that names no model this service may register."""


@dataclass
class Source:
    kind: str  # "mlx" | "hf_cache" | "hf_download" | "gguf"
    # For "hf_download", the repo's folder in the cache (its snapshot is known once fetched).
    path: Path
    suggested_id: str
    # The folder the model's files (and the links among them) must stay inside.
    root: Path | None = None
    # For "hf_download": the repo id and the revision asked for.
    repo: str | None = None
    revision: str | None = None


UNUSABLE = (
    "The source is not a model this client may register: an MLX model directory or a GGUF "
    "file inside the service's model folder or a folder the owner allowed, or the id of a "
    "Hugging Face repo in the local cache."
)


@dataclass
class Allowed:
    """Where a paired client may register from: `folders` (absolute, as configured)."""

    folders: list[Path]

    def check(self, source: str) -> Path:
        """The absolute path `source` names, if it lies inside an allowed folder; otherwise
        `SourceError("source_unusable")`, whatever the reason (no existence oracle)."""
        raw = Path(source).expanduser() if source.startswith("~/") else Path(source)
        if not raw.is_absolute():
            raise unusable()
        lexical = Path(os.path.normpath(raw))
        for folder in self.folders:
            base = Path(os.path.normpath(folder.absolute()))
            if lexical == base or not lexical.is_relative_to(base):
                continue
            # The entry the owner placed in the folder may be a link (a model linked into the
            # model folder); nothing below it may lead out of where that entry leads.
            entry = base / lexical.relative_to(base).parts[0]
            try:
                if lexical.resolve().is_relative_to(entry.resolve()):
                    return lexical
            except (OSError, RuntimeError):
                pass
        raise unusable()


def unusable() -> SourceError:
    return SourceError("source_unusable", UNUSABLE)


def hf_cache_dir() -> Path:
    if "HF_HUB_CACHE" in os.environ:
        return Path(os.environ["HF_HUB_CACHE"])
    home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
    return home / "hub"


def resolve_source(source: str, allowed: Allowed | None = None) -> Source:
    """What `source` names. With `allowed` (a paired client's request), only sources inside
    the allowed folders or Hugging Face repo ids, and one error for every refusal."""
    if source.startswith("hf://"):
        return _from_hub(source)
    if allowed is not None:
        try:
            if HF_REPO.match(source) and not source.startswith(("/", "~", ".")):
                return _from_hf_cache(source)
            return _resolve_source(str(allowed.check(source)))
        except (SourceError, OSError, RuntimeError):
            raise unusable() from None
    try:
        return _resolve_source(source)
    except (OSError, RuntimeError) as e:
        # `~nobody/...` (expanduser), a name too long, a folder we may not read: not a source
        # this service can use, and not a server error.
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise SourceError(
            "source_not_found", f"The source cannot be read: {reason.rstrip('.')}."
        ) from None


def _resolve_source(source: str) -> Source:
    path = Path(source).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise SourceError("source_not_found", f"No GGUF file at '{source}'.")
        return Source("gguf", path.resolve(), _slug(path.stem))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise SourceError(
                "unsupported_source", f"'{source}' has no config.json: not an MLX model directory."
            )
        resolved = path.resolve()
        repo_dir = _hf_repo_of(resolved)
        root = repo_dir if repo_dir is not None else resolved
        return Source("mlx", resolved, _slug(path.name), root=root)
    if HF_REPO.match(source) and not path.exists():
        return _from_hf_cache(source)
    raise SourceError(
        "source_not_found",
        f"'{source}' is neither an MLX model directory, a GGUF file, nor a Hugging Face repo id.",
    )


def materialize(
    source: Source,
    model_dir: Path,
    model_id: str,
    progress: ProgressCallback | None = None,
    task_id: str = "",
) -> Path:
    """The MLX model directory for `source`: converted into the store for a GGUF file, the
    directory itself otherwise (its files stay where they are).

    A conversion never writes into anything that exists (`model_dir_exists`), except a folder
    an earlier attempt of the same registration task left (its marker names the task)."""
    if source.kind == "gguf":
        # Here: the converter imports MLX, which a server that converts nothing never needs.
        from .gguf import convert_gguf

        target = Path(model_dir) / model_id
        if os.path.lexists(target):
            marker = (
                managed.read_marker(target) if managed.owns(target, model_id, model_dir) else None
            )
            if marker is None or not task_id or marker.get("task_id") != task_id:
                raise model_dir_exists(model_id)
            managed.remove(target, model_id, model_dir)
        try:
            return convert_gguf(
                source.path,
                target,
                progress=progress,
                replace=False,
                marker=(managed.MARKER, managed.marker_content(model_id, task_id)),
            )
        except FileExistsError:
            raise model_dir_exists(model_id) from None
    if not (source.path / "config.json").is_file():
        raise SourceError("unsupported_source", f"'{source.path}' has no config.json.")
    return source.path


def model_dir_exists(model_id: str) -> SourceError:
    return SourceError(
        "model_dir_exists",
        f"The model folder already holds an entry named '{model_id}'; a registration never "
        "writes into something that exists. Choose another 'id'.",
    )


def _from_hub(source: str) -> Source:
    parsed = hub.parse(source)
    if parsed is None:
        raise SourceError(
            "invalid_source", "A hub source is written 'hf://ORG/NAME' or 'hf://ORG/NAME@REVISION'."
        )
    repo_id, revision = parsed
    folder = hub.repo_folder(hf_cache_dir(), repo_id)
    return Source(
        "hf_download",
        folder,
        _slug(repo_id.split("/")[1]),
        root=folder,
        repo=repo_id,
        revision=revision,
    )


def _from_hf_cache(repo_id: str) -> Source:
    repo_dir = hub.repo_folder(hf_cache_dir(), repo_id)
    snapshot = _cached_snapshot(repo_dir)
    if snapshot is None:
        raise SourceError(
            "model_not_in_cache",
            f"'{repo_id}' is not in the local Hugging Face cache ({hf_cache_dir()}); this "
            "service never downloads models.",
        )
    # A snapshot's files are links into the repo's `blobs/`: they must stay inside the repo.
    return Source(
        "hf_cache", snapshot.resolve(), _slug(repo_id.split("/")[1]), root=repo_dir.resolve()
    )


def _hf_repo_of(path: Path) -> Path | None:
    """The repo folder of a Hugging Face cache snapshot (`models--o--n/snapshots/REV`)."""
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        return path.parent.parent
    return None


def _cached_snapshot(repo_dir: Path) -> Path | None:
    ref = repo_dir / "refs" / "main"
    snapshots = repo_dir / "snapshots"
    if ref.is_file():
        candidate = snapshots / ref.read_text().strip()
        if (candidate / "config.json").is_file():
            return candidate
    if snapshots.is_dir():
        for candidate in sorted(snapshots.iterdir()):
            if (candidate / "config.json").is_file():
                return candidate
    return None


def _slug(name: str) -> str:
    slug = re.sub(r"[^A-Za-z0-9_.\-]+", "-", name).strip("-.").lower()
    return slug[:100] or "model"
