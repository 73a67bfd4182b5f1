"""The probe: one candidate BLAS tried in a child process, and the verdict on it.

The child (`_child.py`) runs with the environment the worker would get: the candidate's
preload, `OPENBLAS_NUM_THREADS` and `OPENBLAS_CORETYPE`. A crash (SIGILL from a library built
for instructions this CPU lacks), a library the loader ignored or refused, a wrong product, an
`OPENBLAS_CORETYPE` that was not applied, or a timeout rejects the candidate; otherwise it is
accepted with its decode-like and prefill-like matmul times. Whether it is fast enough to win
is `choice.py`'s decision, against the reference BLAS measured the same way.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .candidates import Candidate

CHILD = Path(__file__).with_name("_child.py")
PROBE_TIMEOUT_S = 120.0
REPEATS = 5

ACCEPTED, REJECTED, SKIPPED = "accepted", "rejected", "skipped"


@dataclass
class Verdict:
    """What the probe found for one candidate (times in ms, medians after a warm-up)."""

    name: str
    verdict: str
    reason: str
    origin: str
    library: str | None = None
    coretype: str | None = None
    decode_ms: float | None = None
    prefill_ms: float | None = None
    threads: int | None = None
    threads_honoured: bool | None = None
    config: str | None = None
    corename: str | None = None
    seconds: float | None = None

    @property
    def accepted(self) -> bool:
        return self.verdict == ACCEPTED

    @property
    def score_ms(self) -> float:
        """One decode-like plus one prefill-like matmul: what the choice minimises."""
        return (self.decode_ms or 0.0) + (self.prefill_ms or 0.0)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def probe_env(candidate: Candidate, base: Mapping[str, str], threads: int) -> dict[str, str]:
    """The child's (and the worker's) whole environment for `candidate`."""
    env = dict(base)
    env.update(candidate.worker_env(base))
    if threads > 0:
        env["OPENBLAS_NUM_THREADS"] = str(threads)
    return env


def probe(
    candidate: Candidate,
    *,
    base: Mapping[str, str],
    threads: int = 0,
    repeats: int = REPEATS,
    timeout: float = PROBE_TIMEOUT_S,
) -> Verdict:
    """Run the child for `candidate` and judge what it reports. Never raises."""
    verdict = Verdict(
        candidate.name,
        SKIPPED,
        candidate.skip or "",
        candidate.origin,
        library=None if candidate.library is None else str(candidate.library),
        coretype=candidate.coretype,
    )
    if candidate.skip:
        return verdict
    started = time.monotonic()
    try:
        env = probe_env(candidate, base, threads)
        report = run_child(env, threads, repeats, timeout, candidate.library)
    except ProbeFailed as failure:
        verdict.verdict, verdict.reason = REJECTED, str(failure)
        verdict.seconds = time.monotonic() - started
        return verdict
    verdict.seconds = time.monotonic() - started
    judge(verdict, candidate, report, threads)
    return verdict


class ProbeFailed(Exception):
    """The child did not report: it crashed, timed out, or printed something unreadable."""


def run_child(
    env: Mapping[str, str],
    threads: int,
    repeats: int,
    timeout: float,
    library: Path | None = None,
) -> dict[str, Any]:
    """The child's report; `library` is the preload that must serve `cblas_sgemm`."""
    params = json.dumps(
        {"threads": threads, "repeats": repeats, "library": library and str(library)}
    )
    try:
        completed = subprocess.run(
            [sys.executable, str(CHILD), params],
            env=dict(env),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as error:
        raise ProbeFailed(f"timed out after {error.timeout:.0f} s") from None
    except OSError as error:
        raise ProbeFailed(f"could not start the probe: {error}") from None
    if completed.returncode != 0:
        raise ProbeFailed(describe_exit(completed.returncode, completed.stderr))
    lines = completed.stdout.strip().splitlines()
    try:
        report = json.loads(lines[-1])
    except (IndexError, ValueError):
        raise ProbeFailed(f"unreadable probe output: {completed.stdout[-200:]!r}") from None
    # The loader's complaints (a preload it could not use) go to stderr of a run that went on.
    report["stderr"] = completed.stderr.strip()[-500:]
    return report


def describe_exit(returncode: int, stderr: str) -> str:
    tail = " | ".join(stderr.strip().splitlines()[-3:])
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        if -returncode == signal.SIGILL:
            return (
                "killed by SIGILL (illegal instruction): the library uses instructions this "
                "CPU lacks"
            )
        return f"killed by {name}" + (f": {tail}" if tail else "")
    return f"probe exited with {returncode}" + (f": {tail}" if tail else "")


def judge(verdict: Verdict, candidate: Candidate, report: Mapping[str, Any], threads: int) -> None:
    """Fill `verdict` from the child's `report`: accepted, or rejected and why."""
    verdict.config = report.get("config")
    verdict.corename = report.get("corename")
    verdict.threads = report.get("threads")
    verdict.decode_ms = report.get("decode_ms")
    verdict.prefill_ms = report.get("prefill_ms")
    if threads > 0 and verdict.threads is not None:
        verdict.threads_honoured = verdict.threads == threads
    verdict.verdict, verdict.reason = _decide(candidate, report, threads)


def _decide(candidate: Candidate, report: Mapping[str, Any], threads: int) -> tuple[str, str]:
    served_by = report.get("served_by")
    if candidate.library is not None and (
        served_by is None or Path(served_by).resolve() != candidate.library.resolve()
    ):
        # The loader's complaint names the file; the report keeps host paths apart (`paths`).
        loader = (report.get("stderr") or "").replace(
            str(candidate.library), candidate.library.name
        )
        return REJECTED, (
            f"the library was not used: cblas_sgemm came from "
            f"{Path(served_by).name if served_by else 'mlx itself'}"
            + (f" ({loader.splitlines()[-1]})" if loader else "")
        )
    if not report.get("correct"):
        return REJECTED, f"wrong matmul result (largest error {report.get('max_error')})"
    if candidate.library is None:
        return ACCEPTED, "correct"
    config = report.get("config") or ""
    if candidate.coretype:
        if "DYNAMIC_ARCH" not in config:
            return REJECTED, (
                f"not a DYNAMIC_ARCH build ({config}): OPENBLAS_CORETYPE={candidate.coretype} "
                "has no effect on it"
            )
        if (report.get("corename") or "").lower() != candidate.coretype.lower():
            return REJECTED, (
                f"OPENBLAS_CORETYPE={candidate.coretype} was not applied "
                f"(OpenBLAS chose {report.get('corename')})"
            )
    note = "correct"
    if threads > 0 and report.get("threads") not in (None, threads):
        note += (
            f"; ignores OPENBLAS_NUM_THREADS={threads} (runs {report.get('threads')} threads"
            + (
                ", openblas_set_num_threads works"
                if report.get("threads_after_set") == threads
                else ""
            )
            + ")"
        )
    return ACCEPTED, note
