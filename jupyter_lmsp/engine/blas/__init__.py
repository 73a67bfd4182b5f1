"""Which BLAS the inference worker process runs MLX's float32 matmuls on, and why.

`mlx[cpu]` on Linux ships a reference BLAS: decode 2-3x and prefill ~20x slower than OpenBLAS.
A process cannot change its own dynamic loader setup, so the worker is *started* with an
OpenBLAS preloaded (`LD_PRELOAD`). Which one is decided here, by measurement:

- `candidates`: the libraries found (a DYNAMIC_ARCH OpenBLAS from the `ngsolve-openblas` wheel,
  a system OpenBLAS, `cmeel-openblas` only on CPUs with the AVX-512 it was built for) and mlx's
  reference BLAS;
- `probe`: each one in a child process with the worker's environment: crash (SIGILL), load
  failure, wrong product, timeout reject it; otherwise a decode-like and a prefill-like matmul
  are timed with the worker's thread count;
- `choice`: the fastest correct candidate faster than the reference wins; the verdict is cached
  on disk so a restart does not probe again.

`BlasSelection` is the extension's handle: it chooses once, from the thread that asks first (the
engine client's spawner thread, never the IOLoop), and reports the choice for `GET /service`.
`blas_report()` is the same report as a plain function (for a doctor command), and
`python -m jupyter_lmsp.engine.blas` prints it.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from .candidates import CMEEL, NGSOLVE, REFERENCE, SYSTEM, Candidate, CpuInfo, find_candidates
from .choice import BlasChoice, choose_blas
from .probe import Verdict, probe

__all__ = [
    "CMEEL",
    "NGSOLVE",
    "REFERENCE",
    "SYSTEM",
    "BlasChoice",
    "BlasSelection",
    "Candidate",
    "CpuInfo",
    "Verdict",
    "blas_report",
    "choose_blas",
    "find_candidates",
    "probe",
]


def blas_report(**options: Any) -> dict[str, Any]:
    """The worker's BLAS choice as `GET /service` reports it; `options` as for `choose_blas`."""
    return choose_blas(**options).report()


class BlasSelection:
    """The worker's BLAS, chosen once on first use; thread-safe.

    `worker_env()` blocks while the candidates are probed (call it off the IOLoop: the engine
    client calls it from its spawner thread); `report()` never blocks and says `choosing`
    until the choice is made. With `enabled=False` the worker keeps the reference BLAS.
    """

    def __init__(
        self,
        *,
        enabled: bool = True,
        log: logging.Logger | None = None,
        **options: Any,
    ) -> None:
        self._options = options
        self._log = log or logging.getLogger(__name__)
        self._lock = threading.Lock()
        self._choice: BlasChoice | None = None
        if not enabled:
            self._choice = BlasChoice(REFERENCE, "disabled (use_openblas is 'no')")

    @property
    def choice(self) -> BlasChoice | None:
        return self._choice

    def choose(self) -> BlasChoice:
        with self._lock:
            if self._choice is None:
                choice = choose_blas(**self._options)
                how = (
                    "cached verdict"
                    if choice.cached
                    else f"probed {len(choice.candidates)} candidate(s) in "
                    f"{choice.probe_seconds:.1f} s"
                )
                self._log.info(
                    "LMSP inference worker BLAS: %s (%s; %s)", choice.name, choice.reason, how
                )
                for verdict in choice.candidates:
                    self._log.info(
                        "LMSP BLAS candidate %s: %s, %s (decode %s ms, prefill %s ms, threads %s)",
                        verdict.name,
                        verdict.verdict,
                        verdict.reason,
                        _ms(verdict.decode_ms),
                        _ms(verdict.prefill_ms),
                        verdict.threads,
                    )
                self._choice = choice
            return self._choice

    def worker_env(self) -> dict[str, str]:
        """The variables to add to the worker's environment (blocks while probing)."""
        return dict(self.choose().env)

    def report(self) -> dict[str, Any]:
        choice = self._choice
        return {"state": "choosing"} if choice is None else choice.report()


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"
