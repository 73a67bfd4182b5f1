"""Where a model comes from when it is registered (LMSP B4), and how it becomes an MLX directory.

A source is a local MLX model directory (registered where it is), a Hugging Face repo id found
in the local Hugging Face cache (never downloaded: no hub is reachable, and a service must not
fetch weights behind its user's back), or a GGUF file, converted into the service's model store.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from .gguf import ProgressCallback, convert_gguf

HF_REPO = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")
MODEL_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,99}$")


class SourceError(ValueError):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class Source:
    kind: str  # "mlx" | "hf_cache" | "gguf"
    path: Path
    suggested_id: str


def hf_cache_dir() -> Path:
    if "HF_HUB_CACHE" in os.environ:
        return Path(os.environ["HF_HUB_CACHE"])
    home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
    return home / "hub"


def resolve_source(source: str) -> Source:
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
        return Source("mlx", path.resolve(), _slug(path.name))
    if HF_REPO.match(source) and not path.exists():
        repo_dir = hf_cache_dir() / f"models--{source.replace('/', '--')}"
        snapshot = _cached_snapshot(repo_dir)
        if snapshot is None:
            raise SourceError(
                "model_not_in_cache",
                f"'{source}' is not in the local Hugging Face cache ({hf_cache_dir()}); this "
                "service never downloads models.",
            )
        return Source("hf_cache", snapshot, _slug(source.split("/")[1]))
    raise SourceError(
        "source_not_found",
        f"'{source}' is neither an MLX model directory, a GGUF file, nor a Hugging Face repo id.",
    )


def materialize(
    source: Source, model_dir: Path, model_id: str, progress: ProgressCallback | None = None
) -> Path:
    """The MLX model directory for `source`: converted into the store for a GGUF file, the
    directory itself otherwise (its files stay where they are)."""
    if source.kind == "gguf":
        return convert_gguf(source.path, Path(model_dir) / model_id, progress=progress)
    if not (source.path / "config.json").is_file():
        raise SourceError("unsupported_source", f"'{source.path}' has no config.json.")
    return source.path


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
