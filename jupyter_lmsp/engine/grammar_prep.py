"""Building a job's grammar matcher in the worker, beside its decode loop (issue 43).

llguidance compiles a grammar for a model's tokenizer in native code that drops the GIL, and a
large schema takes seconds (10,000 properties with `additionalProperties` once froze every
generation of the worker for 10.9 s). So the worker never compiles on its decode loop: a job
with a grammar is handed to `MatcherBuilder`, whose thread makes llguidance's tokenizer (once
per model) and the matcher, while the batch goes on decoding; `wake_fd` becomes readable when
one is ready, as the model loader's does, and the job then joins the batch with its matcher.
A job cancelled meanwhile is dropped when its matcher comes back (`forget`).
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from collections.abc import Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import mlx.nn as nn
    from mlx_lm.tokenizer_utils import TokenizerWrapper


@dataclass
class Built:
    """A job's matcher (`matcher`), or why it could not be built (`error`)."""

    job_id: str
    matcher: Any = None
    error: str | None = None


@dataclass
class _Request:
    job_id: str
    model_key: Hashable
    model: nn.Module
    tokenizer: TokenizerWrapper
    grammar: str


class MatcherBuilder:
    def __init__(self) -> None:
        self._requests: queue.SimpleQueue[_Request | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[Built] = queue.SimpleQueue()
        self._forgotten: set[str] = set()
        self._pending: set[str] = set()
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._thread = threading.Thread(target=self._run, name="lmsp-grammar", daemon=True)
        self._thread.start()

    @property
    def wake_fd(self) -> int:
        return self._wake_r

    def pending(self, job_id: str) -> bool:
        with self._lock:
            return job_id in self._pending and job_id not in self._forgotten

    def request(
        self,
        job_id: str,
        model_key: Hashable,
        model: nn.Module,
        tokenizer: TokenizerWrapper,
        grammar: str,
    ) -> None:
        with self._lock:
            self._pending.add(job_id)
        self._requests.put(_Request(job_id, model_key, model, tokenizer, grammar))

    def forget(self, job_id: str) -> bool:
        """Drop `job_id`'s matcher when it comes; whether it was being built."""
        with self._lock:
            if job_id not in self._pending:
                return False
            self._forgotten.add(job_id)
            return True

    def finished(self) -> list[Built]:
        """The matchers built since the last call (drains the wake-up pipe), forgotten jobs'
        left out."""
        with contextlib.suppress(BlockingIOError):
            while os.read(self._wake_r, 4096):
                pass
        out: list[Built] = []
        while True:
            try:
                built = self._done.get_nowait()
            except queue.Empty:
                return out
            with self._lock:
                self._pending.discard(built.job_id)
                if built.job_id in self._forgotten:
                    self._forgotten.discard(built.job_id)
                    continue
            out.append(built)

    def close(self) -> None:
        self._requests.put(None)

    def _run(self) -> None:
        from jupyter_lmsp.engine.constraints import ConstraintError, compile_grammar, ll_tokenizer

        while True:
            request = self._requests.get()
            if request is None:
                return
            with self._lock:
                skip = request.job_id in self._forgotten
            built = Built(request.job_id)
            if not skip:
                try:
                    ll = ll_tokenizer(request.model_key, request.model, request.tokenizer)
                    built.matcher = compile_grammar(ll, request.grammar)
                except ConstraintError as exc:
                    built.error = str(exc)
                except Exception as exc:  # reported as the job's failure, never lost
                    built.error = f"{type(exc).__name__}: {exc}"
            self._done.put(built)
            with contextlib.suppress(OSError):
                os.write(self._wake_w, b"x")
