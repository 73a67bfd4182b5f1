"""Which models the service can run: MLX model directories under the configured model folder.

A model's id is its directory name. (The registry with digests, kept in the `models` table,
replaces this scan when models can be registered; see docs/protocol.md.)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..protocol.errors import LMSPError


@dataclass(frozen=True)
class ModelEntry:
    id: str
    path: Path

    def to_wire(self) -> dict:
        size = sum(f.stat().st_size for f in self.path.iterdir() if f.is_file())
        return {
            "id": self.id,
            "object": "model",
            "created": int(self.path.stat().st_mtime),
            "owned_by": "owner",
            "format": "mlx",
            "path": str(self.path),
            "size_bytes": size,
            "state": "available",
        }


class ModelCatalog:
    def __init__(self, model_dir: Path, default_model: str | None) -> None:
        self.model_dir = Path(model_dir)
        self.default_model = default_model or None

    def list(self) -> list[ModelEntry]:
        if not self.model_dir.is_dir():
            return []
        return [
            ModelEntry(d.name, d)
            for d in sorted(self.model_dir.iterdir())
            if d.is_dir() and (d / "config.json").is_file()
        ]

    def resolve(self, model_id: str | None) -> ModelEntry:
        """The model to run for a request's `model` (the default when None)."""
        wanted = model_id or self.default_model
        if not wanted:
            raise LMSPError(
                400,
                "model_required",
                "No model given and no default model is configured.",
                param="model",
            )
        path = self.model_dir / wanted
        if "/" in wanted or wanted.startswith(".") or not (path / "config.json").is_file():
            raise LMSPError(
                404,
                "model_not_found",
                f"The model '{wanted}' does not exist.",
                type="not_found_error",
                param="model",
            )
        return ModelEntry(wanted, path)
