"""The choice of the worker's BLAS: every candidate probed, the fastest correct one wins.

The rule: the reference BLAS (mlx's own) is always measured; a candidate that is not faster
than it on both the decode-like and the prefill-like matmul is rejected; of the rest, the one
with the least decode + prefill time wins, else the reference.

Probing takes ~1 s per fast candidate and a few seconds for the reference, so the verdict is
cached on disk (`~/.cache/jupyter-lmsp/blas/choice-<key>.json`) under a key made of everything
that can change it: each library's path, size and mtime, the CPU model and flags, the Python
executable, the mlx version, the thread count, `OPENBLAS_CORETYPE` and the preload variables
the worker inherits. A restart reads it back in milliseconds.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import logging
import os
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ..usercache import user_cache_dir
from .candidates import (
    REFERENCE,
    Candidate,
    CpuInfo,
    find_candidates,
    read_cpu,
)
from .probe import PROBE_TIMEOUT_S, REJECTED, REPEATS, Verdict, probe

log = logging.getLogger(__name__)

# Bump when the probe or the rule changes, so verdicts cached by an older version are not used.
PROBE_VERSION = 1


@dataclass
class BlasChoice:
    """The BLAS a worker runs with, why, and every candidate's verdict.

    `env` holds the variables to add to the worker's environment (`LD_PRELOAD`,
    `LD_LIBRARY_PATH`, `OPENBLAS_NUM_THREADS`, `OPENBLAS_CORETYPE`); empty for the reference.
    """

    name: str
    reason: str
    env: dict[str, str] = field(default_factory=dict)
    library: str | None = None
    config: str | None = None
    corename: str | None = None
    threads: int | None = None
    threads_requested: int | None = None
    coretype: str | None = None
    only: list[str] = field(default_factory=list)
    candidates: list[Verdict] = field(default_factory=list)
    probe_seconds: float = 0.0
    probed_at: str | None = None
    cached: bool = False

    @property
    def fast(self) -> bool:
        """A BLAS other than mlx's reference one (Accelerate on macOS counts)."""
        return self.name != REFERENCE

    def worker_environment(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """`base` (default `os.environ`) with this choice's variables."""
        return {**(os.environ if base is None else base), **self.env}

    def report(self) -> dict[str, Any]:
        """The JSON object `GET /service` shows as `blas`. Host paths are under `paths` only."""
        return {
            "state": "chosen",
            "name": self.name,
            "config": self.config,
            "corename": self.corename,
            "threads": self.threads,
            "threads_requested": self.threads_requested,
            "coretype": self.coretype,
            "only": self.only,
            "reason": self.reason,
            "probe_seconds": round(self.probe_seconds, 3),
            "probed_at": self.probed_at,
            "cached": self.cached,
            "candidates": [
                {
                    **{k: _rounded(v) for k, v in verdict.as_dict().items() if k != "library"},
                    "chosen": verdict.name == self.name,
                }
                for verdict in self.candidates
            ],
            "paths": {
                "library": self.library,
                "candidates": {v.name: v.library for v in self.candidates},
            },
        }

    def to_json(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["candidates"] = [v.as_dict() for v in self.candidates]
        del data["env"], data["cached"]
        return data


def choose_blas(
    *,
    threads: int = 0,
    coretype: str = "",
    only: Iterable[str] = (),
    base_env: Mapping[str, str] | None = None,
    candidates: Sequence[Candidate] | None = None,
    cpu: CpuInfo | None = None,
    site_dirs: Sequence[Path] | None = None,
    system_libraries: Sequence[Path] | None = None,
    cache_dir: Path | None = None,
    use_cache: bool = True,
    repeats: int = REPEATS,
    timeout: float = PROBE_TIMEOUT_S,
) -> BlasChoice:
    """Probe the candidates (or read the cached verdict) and choose the worker's BLAS.

    `threads` is the worker's `OPENBLAS_NUM_THREADS` (0: the inherited one or OpenBLAS's
    default); `coretype` its `OPENBLAS_CORETYPE` (""; e.g. "Haswell" masks AVX-512 on a
    DYNAMIC_ARCH build); `only` keeps just the named candidates. `candidates`, `cpu`,
    `site_dirs` and `system_libraries` replace what is found on this machine (tests).
    `cache_dir` holds the verdicts (default `~/.cache/jupyter-lmsp/blas`). Never raises.
    """
    base = dict(os.environ if base_env is None else base_env)
    only = list(only)
    if sys.platform == "darwin":
        return BlasChoice("accelerate", "macOS: MLX uses Accelerate")
    if not sys.platform.startswith("linux"):
        return BlasChoice(REFERENCE, f"no BLAS candidates are known for {sys.platform}")
    threads = threads or _int(base.get("OPENBLAS_NUM_THREADS"))
    coretype = coretype or base.get("OPENBLAS_CORETYPE", "")
    try:
        cpu = cpu or read_cpu()
        cache_root = cache_dir if cache_dir is not None else user_cache_dir() / "blas"
        found = list(
            candidates
            if candidates is not None
            else find_candidates(
                site_dirs=site_dirs,
                system_libraries=system_libraries,
                cpu=cpu,
                coretype=coretype,
                only=only,
                links_dir=None if cache_dir is None else cache_dir / "libs",
            )
        )
        key = _cache_key(found, cpu, threads, coretype, base)
        if use_cache:
            cached = _load(cache_root, key, found, threads, base)
            if cached is not None:
                return cached
        choice = _probe_all(found, base, threads, repeats, timeout)
        choice.coretype, choice.only = coretype or None, list(only)
        if only and len(found) == 1:
            choice.reason = f"no candidate named {', '.join(only)} was found"
        if use_cache:
            _save(cache_root, key, choice)
        return choice
    except Exception as error:  # A fast BLAS is an optimization: never fail the worker over it.
        log.exception("choosing the worker's BLAS failed; it uses the reference BLAS")
        return BlasChoice(REFERENCE, f"choosing a BLAS failed: {error!r}")


def _probe_all(
    found: Sequence[Candidate],
    base: Mapping[str, str],
    threads: int,
    repeats: int,
    timeout: float,
) -> BlasChoice:
    started = time.monotonic()
    by_name: dict[str, Candidate] = {}
    verdicts: list[Verdict] = []
    for candidate in found:
        by_name[candidate.name] = candidate
        verdict = probe(candidate, base=base, threads=threads, repeats=repeats, timeout=timeout)
        verdicts.append(verdict)
    winner, reason = _pick(verdicts)
    chosen = by_name[winner.name]
    env = chosen.worker_env(base)
    if threads > 0:
        env["OPENBLAS_NUM_THREADS"] = str(threads)
    return BlasChoice(
        winner.name,
        reason,
        env,
        library=winner.library,
        config=winner.config,
        corename=winner.corename,
        threads=winner.threads,
        threads_requested=threads or None,
        candidates=verdicts,
        probe_seconds=time.monotonic() - started,
        probed_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    )


def _pick(verdicts: list[Verdict]) -> tuple[Verdict, str]:
    """The winner and why; rejects (in place) the candidates no faster than the reference."""
    reference = next(v for v in verdicts if v.name == REFERENCE)
    others = [v for v in verdicts if v.name != REFERENCE]
    if reference.accepted:
        for v in others:
            if v.accepted and not (
                (v.decode_ms or 0) < (reference.decode_ms or 0)
                and (v.prefill_ms or 0) < (reference.prefill_ms or 0)
            ):
                v.verdict = REJECTED
                v.reason = (
                    f"correct but not faster than the reference BLAS (decode {v.decode_ms:.1f} "
                    f"vs {reference.decode_ms:.1f} ms, prefill {v.prefill_ms:.1f} vs "
                    f"{reference.prefill_ms:.1f} ms)"
                )
    fast = [v for v in others if v.accepted]
    if fast:
        winner = min(fast, key=lambda v: v.score_ms)
        against = (
            f"; reference BLAS {reference.decode_ms:.1f} / {reference.prefill_ms:.1f} ms"
            if reference.accepted
            else f"; the reference BLAS failed its probe: {reference.reason}"
        )
        return winner, (
            f"fastest of {len(fast)} correct candidate(s) faster than the reference: decode-like "
            f"{winner.decode_ms:.1f} ms, prefill-like {winner.prefill_ms:.1f} ms a matmul" + against
        )
    if not others:
        return reference, (
            "no OpenBLAS found (the ngsolve-openblas package provides one on Linux x86-64)"
        )
    return reference, "no candidate passed the probe faster than the reference: " + "; ".join(
        f"{v.name}: {v.reason}" for v in others
    )


# --- the cache ----------------------------------------------------------------------------------


def _cache_key(
    found: Sequence[Candidate],
    cpu: CpuInfo,
    threads: int,
    coretype: str,
    base: Mapping[str, str],
) -> dict[str, Any]:
    versions = {}
    for name in ("mlx", "mlx-cpu"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[name] = importlib.metadata.version(name)
    return {
        "probe_version": PROBE_VERSION,
        "python": sys.executable,
        "mlx": versions,
        "cpu": {"model": cpu.model, "machine": cpu.machine, "flags": sorted(cpu.flags)},
        "threads": threads,
        "coretype": coretype,
        "inherited": {k: base.get(k) for k in ("LD_PRELOAD", "LD_LIBRARY_PATH")},
        "candidates": [c.fingerprint() for c in found],
    }


def _cache_file(cache_root: Path, key: Mapping[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return cache_root / f"choice-{digest}.json"


def _load(
    cache_root: Path,
    key: Mapping[str, Any],
    found: Sequence[Candidate],
    threads: int,
    base: Mapping[str, str],
) -> BlasChoice | None:
    path = _cache_file(cache_root, key)
    try:
        stored = json.loads(path.read_text())
        if stored.get("key") != json.loads(json.dumps(key)):
            return None
        data = stored["choice"]
        verdicts = [Verdict(**v) for v in data.pop("candidates")]
        choice = BlasChoice(**data, candidates=verdicts, cached=True)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    # The environment is rebuilt from the candidates found now (the link folder may be new).
    by_name = {c.name: c for c in found}
    candidate = by_name.get(choice.name)
    if candidate is None:
        return None
    choice.env = candidate.worker_env(base)
    if threads > 0:
        choice.env["OPENBLAS_NUM_THREADS"] = str(threads)
    return choice


def _save(cache_root: Path, key: Mapping[str, Any], choice: BlasChoice) -> None:
    path = _cache_file(cache_root, key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.{os.getpid()}")
        temporary.write_text(json.dumps({"key": key, "choice": choice.to_json()}, indent=1))
        os.replace(temporary, path)
    except OSError as error:
        log.warning("could not cache the BLAS verdict in %s: %s", path, error)


def _rounded(value: Any) -> Any:
    return round(value, 2) if isinstance(value, float) else value


def _int(value: str | None) -> int:
    try:
        return max(0, int(value or 0))
    except ValueError:
        return 0
