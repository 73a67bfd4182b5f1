"""The model registry (LMSP B4): which models exist, their digests, and their state.

Rows live in the `models` table (metadata and digests only); the files stay in their
directories. At start-up, MLX model directories found under the model folder that are not yet
registered are registered in place (hashed once). Registering from another source is a task
(`services.registration`).

The default model (a request that names none) is the configured `default_model`; without one,
the demo model when it is registered, else the model registered first: a service with models
always has a default, with no flag to pass.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..auth.scopes import OWNER, Caller
from ..models import managed
from ..models.demo import DEMO_MODEL_ID
from ..models.digests import DEFAULT_MAX_BYTES, ModelFileError, file_digests, model_digest
from ..protocol.errors import LMSPError, not_found
from ..protocol.objects import model_object
from ..store import models as store
from ..store.database import Database
from ..store.tables import Model

log = logging.getLogger(__name__)


class ModelCatalog:
    # Every request resolves its model; the registry changes rarely (and, from other processes
    # such as the CLI, is seen within this many seconds).
    CACHE_SECONDS = 1.0

    def __init__(
        self,
        db: Database,
        model_dir: Path,
        default_model: str | None,
        max_model_bytes: int = DEFAULT_MAX_BYTES,
    ) -> None:
        self.db = db
        self.model_dir = Path(model_dir)
        self.default_model = default_model or None
        self.max_model_bytes = max_model_bytes
        self._rows: dict[str, Model] = {}
        self._read_at = float("-inf")
        # The bytes a model's weights take in this server's worker, None when not loaded
        # (`services.residency`; None: nobody tells).
        self.residency: Callable[[Model], int | None] | None = None

    def forget(self) -> None:
        """Drop the cached rows (after this process changed the registry)."""
        self._read_at = float("-inf")

    def _get(self, model_id: str) -> Model | None:
        return self._cached().get(model_id)

    def _cached(self) -> dict[str, Model]:
        now = time.monotonic()
        if now - self._read_at > self.CACHE_SECONDS:
            self._rows = {m.id: m for m in store.list_models(self.db)}
            self._read_at = now
        return self._rows

    def default(self) -> str | None:
        """The model a request that names none runs on: the configured `default_model`, else
        the demo model when registered and usable, else the usable model registered first
        (None when there is none)."""
        if self.default_model:
            return self.default_model
        usable = [
            m for m in self._cached().values() if self._state(m) not in ("missing", "corrupt")
        ]
        if any(m.id == DEMO_MODEL_ID for m in usable):
            return DEMO_MODEL_ID
        usable.sort(key=lambda m: (m.created_at, m.id))
        return usable[0].id if usable else None

    def sync_model_dir(self) -> list[str]:
        """Register, in place, every MLX model directory under the model folder not yet known."""
        if not self.model_dir.is_dir():
            return []
        known = {m.id for m in store.list_models(self.db)}
        added = []
        for d in sorted(self.model_dir.iterdir()):
            if d.name in known or d.name.startswith(".") or not (d / "config.json").is_file():
                continue
            taken = self.registered_as(d)
            if taken is not None:
                log.warning("LMSP: %s is already registered as model %s; skipped", d, taken)
                continue
            started = time.monotonic()
            try:
                files = file_digests(d, root=d.resolve(), max_bytes=self.max_model_bytes)
            except ModelFileError as e:
                log.warning("LMSP: model directory %s not registered: %s", d, e.message)
                continue
            store.save_model(
                self.db,
                Model(
                    id=d.name,
                    format="mlx",
                    path=str(d),
                    size_bytes=sum(f["size"] for f in files),
                    digest=model_digest(files),
                    files=json.dumps(files),
                    state="available",
                    source=str(d),
                    created_at=time.time(),
                ),
            )
            log.info(
                "LMSP: registered model %s (%.1fs to hash)", d.name, time.monotonic() - started
            )
            added.append(d.name)
        return added

    def registered_as(self, path: Path) -> str | None:
        """The id a folder is registered under, comparing resolved paths (a trailing `/`, a
        `..` or a link make no second registration of the same files)."""
        try:
            wanted = Path(path).resolve()
        except (OSError, RuntimeError):
            return None
        for model in store.list_models(self.db):
            try:
                if Path(model.path).resolve() == wanted:
                    return model.id
            except (OSError, RuntimeError):
                continue
        return None

    def list(self, caller: Caller = OWNER) -> list[dict[str, Any]]:
        return [
            model_object(m, *self._loaded(m), host_paths=caller.is_owner)
            for m in store.list_models(self.db)
        ]

    def get(self, model_id: str, caller: Caller = OWNER) -> dict[str, Any]:
        model = store.get_model(self.db, model_id)
        if model is None:
            raise not_found("model", model_id, param="model")
        return model_object(model, *self._loaded(model), host_paths=caller.is_owner)

    def _loaded(self, model: Model) -> tuple[str, int | None]:
        """A model's state, `loaded` while the worker holds it, and the bytes it takes."""
        state = self._state(model)
        nbytes = self.residency(model) if self.residency is not None else None
        if nbytes is not None and state == "available":
            state = "loaded"
        return state, nbytes

    def resolve(self, model_id: str | None) -> Model:
        """The model to run for a request's `model` (the default when None)."""
        wanted = model_id or self.default()
        if not wanted:
            raise LMSPError(
                400,
                "model_required",
                "No model given, no default model is configured and no model is registered.",
                param="model",
            )
        model = self._get(wanted)
        if model is None:
            raise LMSPError(
                404,
                "model_not_found",
                f"The model '{wanted}' does not exist.",
                type="not_found_error",
                param="model",
            )
        state = self._state(model)
        if state in ("missing", "corrupt"):
            raise LMSPError(
                409 if state == "corrupt" else 404,
                f"model_{state}",
                f"The model '{wanted}' is {state}: "
                + (
                    "its files no longer match their digests."
                    if state == "corrupt"
                    else "its directory is gone."
                ),
                type="conflict_error" if state == "corrupt" else "not_found_error",
                param="model",
            )
        return model

    def without_paths(self, model_id: str, message: str) -> str:
        """`message` (an engine error, which a paired client may read) with the model's folder
        replaced by its id: no host path in what a client sees."""
        model = self._get(model_id)
        if model is None:
            return message
        for path in sorted({model.path, str(Path(model.path).resolve())}, key=len, reverse=True):
            message = message.replace(path, f"<model {model_id}>")
        return message

    def mark(self, model_id: str, state: str) -> None:
        store.set_model_state(self.db, model_id, state)
        self.forget()

    def delete(self, model_id: str) -> dict[str, Any]:
        """Forget a model. Its files go too only if the service made them: the row says so
        (`managed`) and so does the marker the service wrote in the folder (`models.managed`).
        Anything else stays where it is."""
        model = store.delete_model(self.db, model_id)
        self.forget()
        if model is None:
            raise not_found("model", model_id, param="model")
        if model.managed:
            managed.remove(Path(model.path), model_id, self.model_dir)
        return {"id": model_id, "object": "model", "deleted": True}

    def _state(self, model: Model) -> str:
        if model.state == "corrupt":
            return "corrupt"
        if not Path(model.path, "config.json").is_file():
            return "missing"
        return model.state
