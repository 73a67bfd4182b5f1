"""The OpenBLAS environment for inference worker processes, checked with real subprocesses.

What these tests prove:

1. On Linux with `cmeel-openblas` installed, `worker_environment` returns an environment under
   which a child's mlx matmul runs on OpenBLAS (the child reports OpenBLAS's build string) and
   gives the same numbers as a child without it; the symlink folder points into mlx's bundled
   libraries; the caller's other variables are kept.
2. Without `cmeel-openblas` where it looks (an empty site dir), or with a broken library that
   the loader cannot use, it returns `(None, "reference")` without raising.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from prerequisites import require, require_linux

from jupyter_lmsp.engine.blas import (
    OPENBLAS_RELATIVE,
    prepare_worker_blas,
    probe_subprocess,
    worker_environment,
)

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux recipe")


def _has_cmeel_openblas() -> bool:
    try:
        importlib.metadata.distribution("cmeel-openblas")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.fixture
def cmeel_openblas() -> None:
    """cmeel-openblas on Linux (a dependency there: missing, the test fails under `CI`)."""
    require_linux("the OpenBLAS recipe")
    require(_has_cmeel_openblas(), "cmeel-openblas (a dependency on Linux)")


needs_openblas = pytest.mark.usefixtures("cmeel_openblas")

# The matmul size of a 484-token prompt through SmolLM2's up projection.
_MATMUL_SCRIPT = r"""
import json, time
import mlx.core as mx
a = mx.random.normal((484, 576), key=mx.random.key(3))
b = mx.random.normal((576, 1536), key=mx.random.key(4))
mx.eval(a, b)
start = time.perf_counter()
c = a @ b
mx.eval(c)
print(json.dumps({"seconds": time.perf_counter() - start, "values": c[::37, ::53].tolist()}))
"""


def _run_matmul(env: dict[str, str] | None) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _MATMUL_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(out.stdout)


@needs_openblas
def test_openblas_environment_gives_the_same_matmul(tmp_path: Path) -> None:
    base = dict(os.environ, LMSP_TEST_MARKER="kept", LD_LIBRARY_PATH="/nonexistent-lib-dir")
    env, blas = worker_environment(base, cache_dir=tmp_path)
    assert blas == "openblas"
    assert env is not None
    assert env["LMSP_TEST_MARKER"] == "kept"
    assert env["LD_PRELOAD"].split()[0].endswith(str(OPENBLAS_RELATIVE))
    folder, *rest = env["LD_LIBRARY_PATH"].split(":")
    assert rest == ["/nonexistent-lib-dir"]
    gfortran = Path(folder) / "libgfortran.so.5"
    assert gfortran.is_symlink() and gfortran.resolve().parent.name == "mlx_cpu.libs"
    assert list(Path(folder).glob("libquadmath-*.so*")), "the mangled libgfortran needs it"

    fast, reference = probe_subprocess(env), probe_subprocess(None)
    assert fast["close"] and reference["close"]
    assert fast["openblas_config"].startswith("OpenBLAS")
    assert reference["openblas_config"] is None

    with_openblas, without = _run_matmul(env), _run_matmul(None)
    for row_fast, row_reference in zip(with_openblas["values"], without["values"], strict=True):
        for x, y in zip(row_fast, row_reference, strict=True):
            assert abs(x - y) <= 1e-3 * max(1.0, abs(y))
    print(
        f"484x576·576x1536: OpenBLAS {with_openblas['seconds'] * 1e3:.1f} ms, "
        f"reference {without['seconds'] * 1e3:.1f} ms"
    )


@linux_only
def test_falls_back_when_cmeel_openblas_is_not_found(tmp_path: Path) -> None:
    empty_site = tmp_path / "site-packages"
    empty_site.mkdir()
    base = {"PATH": os.environ.get("PATH", "")}
    assert worker_environment(base, site_dirs=[empty_site], cache_dir=tmp_path) == (
        None,
        "reference",
    )
    result = prepare_worker_blas(base, site_dirs=[empty_site], cache_dir=tmp_path)
    assert "cmeel-openblas" in result.reason
    assert base == {"PATH": os.environ.get("PATH", "")}, "the caller's mapping is not changed"


@linux_only
def test_falls_back_when_the_library_does_not_load(tmp_path: Path) -> None:
    site_dir = tmp_path / "site-packages"
    broken = site_dir / OPENBLAS_RELATIVE
    broken.parent.mkdir(parents=True)
    broken.write_bytes(b"not an ELF file")
    result = prepare_worker_blas(site_dirs=[site_dir], cache_dir=tmp_path / "cache")
    assert (result.env, result.blas) == (None, "reference")
    assert "probe" in result.reason
