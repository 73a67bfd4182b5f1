"""The inference worker's BLAS: candidates, the probe, the choice, its cache and its report.

What these tests prove, with real child processes and real libraries (none asserts which BLAS
a machine picks, only that the pick passed the probe and beats the reference):

1. On Linux x86-64 (where the default dependency `ngsolve-openblas` is installed) the chosen
   BLAS is not the reference one, passed the probe, is faster than the reference on both
   matmuls, and a child started with its environment computes the reference's numbers.
2. The other machine's case, on any machine: with `OPENBLAS_CORETYPE=Haswell` (AVX-512 masked)
   the DYNAMIC_ARCH candidate is accepted, runs Haswell kernels and is right; a process that
   dies with SIGILL, a library the loader cannot use, a hang (timeout) and a wrong product are
   rejected; `cmeel-openblas` (a fixed SKYLAKEX build) is skipped with its reason on a CPU
   without AVX-512, or when a core type is asked for.
3. A candidate not faster than the reference never wins; the thread count the worker will
   use is the one probed and reported, and a BLAS that ignores it is reported so.
4. The verdict is cached on disk under a key of everything that can change it; a second
   process reads it instead of probing.
5. `python -m jupyter_lmsp.engine.blas` prints the candidates, their speed and the choice;
   `GET /lmsp/v1/service` reports it, and the IOLoop answers while the probe runs.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
from jpserver import call, server_config
from jsonschema import Draft202012Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from jupyter_lmsp.engine.blas import (
    CMEEL,
    NGSOLVE,
    REFERENCE,
    BlasChoice,
    Candidate,
    CpuInfo,
    Verdict,
    choose_blas,
    find_candidates,
    probe,
)
from jupyter_lmsp.engine.blas.candidates import AVX512_FLAGS, CMEEL_RELATIVE
from jupyter_lmsp.engine.blas.choice import _cache_key, _pick
from jupyter_lmsp.engine.blas.probe import ACCEPTED, REJECTED, SKIPPED, judge
from jupyter_lmsp.handlers.routes import endpoints
from jupyter_lmsp.protocol.openapi import openapi_document

pytest_plugins = ["pytest_jupyter.jupyter_server"]

LINUX = sys.platform.startswith("linux")
LINUX_X86_64 = LINUX and platform.machine() == "x86_64"
linux_only = pytest.mark.skipif(not LINUX, reason="the BLAS candidates are a Linux recipe")
# ngsolve-openblas is a dependency on Linux x86-64: where it should be, its absence fails.
linux_x86_64 = pytest.mark.skipif(not LINUX_X86_64, reason="ngsolve-openblas: Linux x86-64")
# The tests that run real probes (candidate libraries multiplying matrices in child processes,
# ~60 s of CPU in all) are left out of `make test-fast`: they change only with engine/blas.
probes = pytest.mark.slow


def base_env(**extra: str) -> dict[str, str]:
    """This environment without the OpenBLAS variables a test wants to control."""
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_CORETYPE", "LD_PRELOAD")}
    env.update(extra)
    return env


def ngsolve(tmp_path: Path, coretype: str = "") -> Candidate:
    found = find_candidates(only=[NGSOLVE], coretype=coretype, links_dir=tmp_path / "libs")
    names = [c.name for c in found]
    assert names == [REFERENCE, NGSOLVE], f"ngsolve-openblas is a dependency here: {names}"
    return found[1]


def dies_with(tmp_path: Path, code: str) -> dict[str, str]:
    """An environment whose Python runs `code` at start-up (sitecustomize) before the probe."""
    folder = tmp_path / "sitecustomize"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(code)
    return {"PYTHONPATH": str(folder)}


MLX_REFERENCE = Candidate(REFERENCE, None, "the reference BLAS bundled with mlx[cpu]")

# The matmul size of a 484-token prompt through SmolLM2's up projection.
_MATMUL_SCRIPT = r"""
import json
import mlx.core as mx
a = mx.random.normal((484, 576), key=mx.random.key(3))
b = mx.random.normal((576, 1536), key=mx.random.key(4))
print(json.dumps((a @ b)[::37, ::53].tolist()))
"""


def _run_matmul(env: dict[str, str]) -> list[list[float]]:
    out = subprocess.run(
        [sys.executable, "-c", _MATMUL_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(out.stdout)


# --- 1. the choice on this machine ----------------------------------------------------------


@probes
@linux_x86_64
def test_the_chosen_blas_passed_the_probe_and_beats_the_reference(worker_blas: BlasChoice) -> None:
    verdicts = {v.name: v for v in worker_blas.candidates}
    chosen, reference = verdicts[worker_blas.name], verdicts[REFERENCE]
    assert worker_blas.fast and worker_blas.name != REFERENCE, worker_blas.reason
    assert chosen.verdict == ACCEPTED and reference.verdict == ACCEPTED
    assert chosen.decode_ms < reference.decode_ms and chosen.prefill_ms < reference.prefill_ms
    assert worker_blas.config and worker_blas.config.startswith("OpenBLAS")
    assert worker_blas.env["LD_PRELOAD"].split()[0] == worker_blas.library
    assert worker_blas.threads == worker_blas.threads_requested == 1
    assert worker_blas.env["OPENBLAS_NUM_THREADS"] == "1"
    # Only an accepted candidate can be chosen; every other carries its verdict and reason.
    assert all(v.reason for v in worker_blas.candidates)
    assert {v.verdict for v in worker_blas.candidates} <= {ACCEPTED, REJECTED, SKIPPED}

    fast = _run_matmul(worker_blas.worker_environment())
    slow = _run_matmul(base_env())
    for row_fast, row_slow in zip(fast, slow, strict=True):
        for x, y in zip(row_fast, row_slow, strict=True):
            assert abs(x - y) <= 1e-3 * max(1.0, abs(y))


@linux_x86_64
def test_the_worker_environment_keeps_the_callers_variables(
    tmp_path: Path, worker_blas: BlasChoice
) -> None:
    base = base_env(LMSP_TEST_MARKER="kept", LD_LIBRARY_PATH="/nonexistent-lib-dir")
    env = ngsolve(tmp_path).worker_env(base)
    folder, *rest = env["LD_LIBRARY_PATH"].split(":")
    assert rest == ["/nonexistent-lib-dir"]
    gfortran = Path(folder) / "libgfortran.so.5"
    assert gfortran.is_symlink() and gfortran.resolve().parent.name == "mlx_cpu.libs"
    assert list(Path(folder).glob("libquadmath-*.so*")), "the mangled libgfortran needs it"
    assert base["LD_LIBRARY_PATH"] == "/nonexistent-lib-dir", "the caller's mapping is unchanged"
    whole = worker_blas.worker_environment(base)
    assert (
        whole["LMSP_TEST_MARKER"] == "kept" and whole["LD_PRELOAD"] == worker_blas.env["LD_PRELOAD"]
    )


# --- 2. the other machine's case ------------------------------------------------------------


@probes
@linux_x86_64
def test_a_dynamic_arch_candidate_masked_to_haswell_is_accepted_and_right(tmp_path: Path) -> None:
    candidate = ngsolve(tmp_path, coretype="Haswell")
    assert candidate.worker_env({})["OPENBLAS_CORETYPE"] == "Haswell"
    verdict = probe(candidate, base=base_env(), threads=1, repeats=1)
    assert verdict.verdict == ACCEPTED, verdict.reason
    assert verdict.corename == "Haswell" and "DYNAMIC_ARCH" in (verdict.config or "")
    assert verdict.threads == 1 and verdict.threads_honoured

    # The whole choice, masked: cmeel-openblas (where installed) is skipped, not probed.
    choice = choose_blas(
        threads=1, coretype="Haswell", base_env=base_env(), cache_dir=tmp_path, repeats=1
    )
    assert choice.name != REFERENCE and choice.coretype == "Haswell"
    assert choice.corename == "Haswell" and choice.env["OPENBLAS_CORETYPE"] == "Haswell"
    for v in choice.candidates:
        if v.name == CMEEL:
            assert v.verdict == SKIPPED and "OPENBLAS_CORETYPE=Haswell" in v.reason


@probes
@linux_x86_64
def test_the_probe_rejects_a_process_killed_by_sigill(tmp_path: Path) -> None:
    # Stands in for a library built for instructions this CPU lacks (cmeel-openblas on a CPU
    # without AVX-512): the child dies of SIGILL.
    real = ngsolve(tmp_path)
    dying = Candidate(
        "avx512-only",
        real.library,
        "a library that raises SIGILL",
        {
            **real.env,
            **dies_with(tmp_path, "import os, signal\nos.kill(os.getpid(), signal.SIGILL)\n"),
        },
    )
    verdict = probe(dying, base=base_env(), threads=1)
    assert verdict.verdict == REJECTED and "SIGILL" in verdict.reason
    assert verdict.decode_ms is None

    choice = choose_blas(
        threads=1,
        base_env=base_env(),
        candidates=[MLX_REFERENCE, dying, real],
        cache_dir=tmp_path,
        repeats=1,
    )
    assert choice.name == NGSOLVE, choice.reason
    assert {v.name: v.verdict for v in choice.candidates}["avx512-only"] == REJECTED


@linux_only
def test_the_probe_rejects_a_library_the_loader_cannot_use(tmp_path: Path) -> None:
    broken = tmp_path / "libopenblas.so.0"
    broken.write_bytes(b"not an ELF file")
    verdict = probe(Candidate("broken", broken, "a broken file"), base=base_env(), threads=1)
    assert verdict.verdict == REJECTED
    assert "not used" in verdict.reason and "mlx itself" in verdict.reason


@probes
@linux_only
def test_the_probe_rejects_a_candidate_that_hangs(tmp_path: Path) -> None:
    hang = Candidate("hangs", None, "hangs", dies_with(tmp_path, "import time\ntime.sleep(60)\n"))
    verdict = probe(hang, base=base_env(), threads=1, timeout=2)
    assert verdict.verdict == REJECTED and "timed out" in verdict.reason


@probes
@linux_only
def test_an_unknown_candidate_name_is_said_so(tmp_path: Path) -> None:
    choice = choose_blas(
        threads=1, only=["no-such-blas"], base_env=base_env(), cache_dir=tmp_path, repeats=1
    )
    assert choice.name == REFERENCE and choice.only == ["no-such-blas"]
    assert choice.reason == "no candidate named no-such-blas was found"


def test_a_wrong_product_or_an_ignored_core_type_is_rejected() -> None:
    library = Path("/opt/lib/libopenblas.so.0")
    good = {
        "correct": True,
        "served_by": str(library),
        "config": "OpenBLAS 0.3.33 DYNAMIC_ARCH Haswell",
        "corename": "Haswell",
        "threads": 1,
        "decode_ms": 10.0,
        "prefill_ms": 5.0,
    }

    def verdict_for(report: dict, coretype: str | None = None) -> Verdict:
        candidate = Candidate("c", library, "test", coretype=coretype)
        verdict = Verdict("c", SKIPPED, "", "test")
        judge(verdict, candidate, report, threads=1)
        return verdict

    assert verdict_for(good).verdict == ACCEPTED
    wrong = verdict_for({**good, "correct": False, "max_error": 3.5})
    assert wrong.verdict == REJECTED and "wrong matmul result" in wrong.reason
    fixed = verdict_for({**good, "config": "OpenBLAS 0.3.31 SKYLAKEX"}, coretype="Haswell")
    assert fixed.verdict == REJECTED and "not a DYNAMIC_ARCH build" in fixed.reason
    ignored = verdict_for({**good, "corename": "Zen"}, coretype="Haswell")
    assert ignored.verdict == REJECTED and "was not applied" in ignored.reason
    threads = verdict_for({**good, "threads": 4, "threads_after_set": 1})
    assert threads.verdict == ACCEPTED and threads.threads_honoured is False
    assert "ignores OPENBLAS_NUM_THREADS=1" in threads.reason


@probes
@linux_only
def test_cmeel_is_skipped_where_the_cpu_lacks_avx512(tmp_path: Path) -> None:
    site = tmp_path / "site-packages"
    (site / CMEEL_RELATIVE).parent.mkdir(parents=True)
    (site / CMEEL_RELATIVE).write_bytes(b"")
    avx2 = CpuInfo("an AVX2 CPU", frozenset({"sse4_2", "avx", "avx2", "fma"}), "x86_64")
    avx512 = CpuInfo("an AVX-512 CPU", frozenset({"avx2", *AVX512_FLAGS}), "x86_64")

    def cmeel(cpu: CpuInfo, coretype: str = "") -> Candidate:
        found = find_candidates(
            site_dirs=[site], system_libraries=[], cpu=cpu, coretype=coretype, links_dir=tmp_path
        )
        assert [c.name for c in found] == [REFERENCE, CMEEL]
        return found[1]

    skipped = cmeel(avx2)
    assert skipped.skip and "AVX-512" in skipped.skip and "avx512f" in skipped.skip
    assert "illegal instruction" in skipped.skip
    assert cmeel(avx512).skip is None
    assert "OPENBLAS_CORETYPE=Haswell" in (cmeel(avx512, "Haswell").skip or "")

    # Skipped candidates are reported, never probed (the real /proc/cpuinfo is not consulted).
    choice = choose_blas(
        threads=1,
        base_env=base_env(),
        candidates=[MLX_REFERENCE, skipped],
        cache_dir=tmp_path,
        repeats=1,
    )
    assert choice.name == REFERENCE
    report = {c["name"]: c for c in choice.report()["candidates"]}
    assert report[CMEEL]["verdict"] == SKIPPED and report[CMEEL]["seconds"] is None
    assert "AVX-512" in choice.reason


def test_a_candidate_not_faster_than_the_reference_never_wins() -> None:
    def measured(name: str, decode: float, prefill: float) -> Verdict:
        return Verdict(name, ACCEPTED, "correct", "test", decode_ms=decode, prefill_ms=prefill)

    reference = measured(REFERENCE, 100.0, 200.0)
    slow_prefill = measured("slow-prefill", 20.0, 250.0)
    slower = measured("slower", 150.0, 300.0)
    winner, reason = _pick([reference, slow_prefill, slower])
    assert winner is reference and "no candidate" in reason
    assert slow_prefill.verdict == slower.verdict == REJECTED
    assert "not faster than the reference" in slower.reason

    fast, faster = measured("fast", 30.0, 10.0), measured("faster", 20.0, 8.0)
    winner, reason = _pick([measured(REFERENCE, 100.0, 200.0), fast, faster])
    assert winner is faster and fast.verdict == ACCEPTED and "fastest of 2" in reason


# --- 3. threads ---------------------------------------------------------------------------


@probes
@linux_x86_64
def test_the_probe_runs_and_reports_the_workers_thread_count(tmp_path: Path) -> None:
    candidate = ngsolve(tmp_path)
    for threads in (1, 2):
        verdict = probe(candidate, base=base_env(), threads=threads, repeats=1)
        assert verdict.verdict == ACCEPTED, verdict.reason
        assert verdict.threads == threads and verdict.threads_honoured is True
    reference = probe(MLX_REFERENCE, base=base_env(), threads=1, repeats=1)
    assert reference.verdict == ACCEPTED and reference.threads is None


# --- 4. the cache -------------------------------------------------------------------------


def test_the_cache_key_changes_with_everything_that_can_change_the_verdict(tmp_path: Path) -> None:
    library = tmp_path / "libopenblas.so.0"
    library.write_bytes(b"v1")
    candidates = [Candidate(REFERENCE, None, "ref"), Candidate("lib", library, "lib")]
    cpu = CpuInfo("cpu", frozenset({"avx2"}), "x86_64")
    base = {"LD_PRELOAD": ""}
    key = _cache_key(candidates, cpu, 1, "", base)
    assert key == _cache_key(candidates, cpu, 1, "", base)
    assert key != _cache_key(candidates, cpu, 2, "", base)
    assert key != _cache_key(candidates, cpu, 1, "Haswell", base)
    assert key != _cache_key(
        candidates, CpuInfo("cpu", frozenset({"avx2", "avx512f"})), 1, "", base
    )
    assert key != _cache_key(candidates, cpu, 1, "", {"LD_PRELOAD": "/x.so"})
    library.write_bytes(b"version 2")  # another size (and mtime)
    assert key != _cache_key(candidates, cpu, 1, "", base)
    assert key["python"] == sys.executable and "mlx" in key["mlx"]


@probes
@linux_x86_64
def test_a_restart_reads_the_cached_verdict_instead_of_probing(tmp_path: Path) -> None:
    env = {**base_env(), "XDG_CACHE_HOME": str(tmp_path)}
    command = [sys.executable, "-m", "jupyter_lmsp.engine.blas", "--threads", "1"]
    first = subprocess.run(
        [*command, "--only", NGSOLVE, "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert first.returncode == 0, first.stderr
    report = json.loads(first.stdout)
    assert report["name"] == NGSOLVE and report["cached"] is False
    assert [c["name"] for c in report["candidates"]] == [REFERENCE, NGSOLVE]
    assert all(c["decode_ms"] and c["prefill_ms"] for c in report["candidates"])
    assert report["paths"]["library"].endswith(".so") and "paths" not in report["candidates"][0]
    assert list((tmp_path / "jupyter-lmsp" / "blas").glob("choice-*.json"))

    second = subprocess.run(
        [*command, "--only", NGSOLVE], env=env, capture_output=True, text=True, timeout=300
    )
    assert second.returncode == 0, second.stderr
    assert "cached verdict" in second.stdout and f"chosen: {NGSOLVE}" in second.stdout
    for name in (REFERENCE, NGSOLVE):
        assert name in second.stdout
    assert "decode ms" in second.stdout and "AVX-512" in second.stdout


# --- 5. the service reports it ------------------------------------------------------------


@pytest.fixture
def jp_server_config(lmsp_data, request, tmp_path, monkeypatch):
    # A fresh verdict cache, so the server probes, and the probe's base without a preset mask.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("OPENBLAS_CORETYPE", raising=False)
    return server_config(lmsp_data, request, use_openblas="auto", blas_threads=1)


@probes
@linux_only
async def test_the_service_reports_the_choice_and_answers_while_probing(jp_fetch) -> None:
    status, service, _ = await call(jp_fetch, "GET", "service")
    assert status == 200
    # The probe (seconds: the reference BLAS alone is timed for ~2 s) runs off the IOLoop.
    assert service["blas"] == {"state": "choosing"}
    for _ in range(2400):
        _, service, _ = await call(jp_fetch, "GET", "service")
        if service["blas"]["state"] == "chosen" and service["worker"]["state"] == "ready":
            break
        await asyncio.sleep(0.05)
    blas = service["blas"]
    assert blas["state"] == "chosen" and service["worker"]["state"] == "ready", service
    document = openapi_document(endpoints())
    registry: Registry = Registry().with_resource(
        "urn:lmsp", Resource.from_contents(document, default_specification=DRAFT202012)
    )
    schema = {"$ref": "urn:lmsp#/components/schemas/Blas"}
    errors = list(Draft202012Validator(schema, registry=registry).iter_errors(blas))
    assert not errors, [e.message for e in errors]
    chosen = [c for c in blas["candidates"] if c["chosen"]]
    assert [c["name"] for c in chosen] == [blas["name"]]
    assert chosen[0]["verdict"] == ACCEPTED and blas["reason"]
    assert blas["threads_requested"] == 1 and blas["cached"] is False
    assert blas["probe_seconds"] > 0
    assert REFERENCE in [c["name"] for c in blas["candidates"]]
    # Host paths are kept apart, so that they can be withheld from some callers.
    assert set(blas["paths"]) == {"library", "candidates"}
    assert not any("/" in str(c.get("library", "")) for c in blas["candidates"])
    # The worker itself confirms which kind of BLAS it runs on.
    assert service["worker"]["blas"] == ("reference" if blas["name"] == REFERENCE else "openblas")
    if LINUX_X86_64:
        assert blas["name"] != REFERENCE and blas["threads"] == 1
        assert Path(blas["paths"]["library"]).exists()
