"""Loading models in the inference worker without stopping its decode loop.

A model's files are verified (`models.verify`) and loaded (`mlx_lm.load`) in a thread of the
worker, one model at a time, while the worker's loop goes on decoding the jobs it already
runs. The loop hands `request(key, path, expected_files)` over, and picks finished loads up
with `finished()` between two steps; `wake_fd` becomes readable when one is ready, so an idle
loop waiting on its pipe wakes for it. `cancel(key)` stops a load nobody waits for any more:
hashing stops within one chunk.

Verification is cached per file (`models.verify.Verifier`), and repeated after the load: if a
file changed identity while it was loaded, the load is thrown away and the model refused, so
the weights in memory are the bytes that were verified (docs/architecture.md, "Models, loading and resuming").

Everything the model holds (parameters and other arrays, such as rotary tables) is evaluated in
the loading thread, so the loop's thread later uses only materialized arrays.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..models.verify import Cancelled, Mismatch, Verifier

if TYPE_CHECKING:
    import mlx.nn as nn
    from mlx_lm.tokenizer_utils import TokenizerWrapper

log = logging.getLogger(__name__)


@dataclass
class LoadResult:
    key: tuple[Any, ...]
    model: nn.Module | None = None
    tokenizer: TokenizerWrapper | None = None
    # Set when the load failed: a JobFailed code and message for every job waiting on it.
    code: str | None = None
    message: str = ""
    cancelled: bool = False


@dataclass
class _Request:
    key: tuple[Any, ...]
    path: Path
    expected_files: list[dict[str, Any]] | None
    cancel: threading.Event = field(default_factory=threading.Event)


class ModelLoader:
    def __init__(self, verifier: Verifier | None = None) -> None:
        self.verifier = verifier or Verifier()
        self._requests: queue.SimpleQueue[_Request | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[LoadResult] = queue.SimpleQueue()
        self._pending: dict[tuple[Any, ...], _Request] = {}
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._thread = threading.Thread(target=self._run, name="lmsp-model-loader", daemon=True)
        self._thread.start()

    @property
    def wake_fd(self) -> int:
        return self._wake_r

    def loading(self, key: tuple[Any, ...]) -> bool:
        with self._lock:
            return key in self._pending

    def request(
        self, key: tuple[Any, ...], path: Path, expected_files: list[dict[str, Any]] | None
    ) -> None:
        """Load the model at `path` under `key` (once, however often it is asked for)."""
        with self._lock:
            if key in self._pending:
                return
            request = self._pending[key] = _Request(key, path, expected_files)
        self._requests.put(request)

    def cancel(self, key: tuple[Any, ...]) -> None:
        with self._lock:
            request = self._pending.get(key)
        if request is not None:
            request.cancel.set()

    def finished(self) -> list[LoadResult]:
        """The loads that ended since the last call (drains the wake-up pipe)."""
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        with self._lock:
            for request in self._pending.values():
                request.cancel.set()
        self._requests.put(None)

    def _run(self) -> None:
        while True:
            request = self._requests.get()
            if request is None:
                return
            result = self._load(request)
            with self._lock:
                self._pending.pop(request.key, None)
            self._done.put(result)
            with contextlib.suppress(OSError):
                os.write(self._wake_w, b"x")

    def _load(self, request: _Request) -> LoadResult:
        result = LoadResult(request.key)
        if request.cancel.is_set():
            result.cancelled = True
            return result
        try:
            identities = None
            if request.expected_files is not None:
                identities = self.verifier.check(
                    request.path, request.expected_files, request.cancel
                )
            model, tokenizer = _load_mlx(request.path)
            if identities is not None:
                changed = self.verifier.changed(request.path, identities)
                if changed:
                    raise Mismatch(
                        f"{len(changed)} file(s) of the model changed while it was loaded: "
                        + ", ".join(changed[:5]),
                        changed,
                    )
        except Cancelled:
            result.cancelled = True
        except Mismatch as e:
            result.code, result.message = e.code, e.message
        except Exception as e:
            log.exception("loading %s failed", request.path)
            result.code, result.message = "model_load_failed", f"{type(e).__name__}: {e}"
        else:
            result.model, result.tokenizer = model, tokenizer
        return result


def _load_mlx(path: Path) -> tuple[nn.Module, TokenizerWrapper]:
    import mlx.core as mx
    from mlx_lm import load

    model, tokenizer = load(str(path))[:2]
    # `load` evaluates the parameters; arrays a module keeps outside them (rotary frequency
    # tables, masks) are evaluated here too, in this thread, before the loop's thread uses them.
    arrays = [
        value
        for module in model.modules()
        for value in vars(module).values()
        if isinstance(value, mx.array)
    ]
    if arrays:
        mx.eval(arrays)
    return model, tokenizer
