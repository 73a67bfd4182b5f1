"""The environment that gives an inference worker process OpenBLAS instead of a reference BLAS.

`mlx[cpu]` on Linux ships a reference BLAS; preloading OpenBLAS from the PyPI wheel
`cmeel-openblas` makes float32 matmuls ~100× and decoding ~2.3× faster. A process cannot change
its own dynamic loader setup, so this only helps a worker started with the returned environment.

OpenBLAS needs `libgfortran.so.5`, which a fresh machine lacks. `mlx[cpu]` bundles a copy under a
mangled name (`mlx_cpu.libs/libgfortran-<hash>.so.5.0.0`, needing `libquadmath-<hash>.so...`),
so a private folder of symlinks — `libgfortran.so.5` and the libquadmath under its own name —
put on `LD_LIBRARY_PATH` satisfies the loader. The environment is verified once per process by a
tiny subprocess that imports `mlx.core` and checks a matmul; on any failure the worker runs with
the reference BLAS (on macOS MLX already uses Accelerate).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import site
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

OPENBLAS_RELATIVE = Path("cmeel.prefix") / "lib" / "libopenblas.so.0"
MLX_BUNDLED_LIBS = "mlx_cpu.libs"
PROBE_TIMEOUT_S = 120.0

# Runs in the child: proves mlx imports and multiplies correctly, and says which BLAS served it.
# The reference product is computed elementwise, which does not go through BLAS at all.
_PROBE_SCRIPT = r"""
import ctypes, json
import mlx.core as mx
a = mx.random.normal((48, 40), key=mx.random.key(1))
b = mx.random.normal((40, 56), key=mx.random.key(2))
product = a @ b
expected = (a[:, :, None] * b[None, :, :]).sum(axis=1)
close = mx.allclose(product, expected, rtol=1e-4, atol=1e-4).item()
with open("/proc/self/maps") as maps:
    loaded = sorted({line.split()[-1] for line in maps if "blas" in line.rsplit("/", 1)[-1]})
config = None
try:
    get_config = ctypes.CDLL(None).openblas_get_config
    get_config.restype = ctypes.c_char_p
    config = get_config().decode()
except (AttributeError, OSError):
    pass
print(json.dumps({"close": close, "blas_libraries": loaded, "openblas_config": config}))
"""


@dataclass(frozen=True)
class WorkerBlas:
    """The outcome of preparing a worker's BLAS: `env` is None when the worker should inherit."""

    env: dict[str, str] | None
    blas: str
    reason: str


_verdicts: dict[tuple[str, ...], tuple[bool, str]] = {}
_verdicts_lock = threading.Lock()


def worker_environment(
    base: Mapping[str, str] | None = None,
    *,
    site_dirs: Sequence[Path] | None = None,
    cache_dir: Path | None = None,
) -> tuple[dict[str, str] | None, str]:
    """The environment for a fast inference worker process and the BLAS it will use.

    Returns `(env, "openblas")` with `env` = `base` (default `os.environ`) plus `LD_PRELOAD` and
    `LD_LIBRARY_PATH`, or `(None, "reference")` / `(None, "accelerate")` when the worker should
    simply inherit the environment. Never raises; the reason for a fallback is logged and
    available from `prepare_worker_blas`. `site_dirs` replaces the site-packages directories
    searched for `cmeel.prefix/` and `mlx_cpu.libs/`; `cache_dir` holds the symlink folder.
    """
    result = prepare_worker_blas(base, site_dirs=site_dirs, cache_dir=cache_dir)
    return result.env, result.blas


def prepare_worker_blas(
    base: Mapping[str, str] | None = None,
    *,
    site_dirs: Sequence[Path] | None = None,
    cache_dir: Path | None = None,
) -> WorkerBlas:
    """Like `worker_environment`, also saying why a fallback was chosen."""
    try:
        return _prepare(
            dict(os.environ if base is None else base),
            site_dirs=site_dirs,
            cache_dir=cache_dir,
        )
    except Exception as error:  # A fast BLAS is an optimization: never fail the worker over it.
        log.warning("OpenBLAS unavailable, the worker uses the reference BLAS: %r", error)
        return WorkerBlas(None, "reference", f"unexpected error: {error!r}")


def _prepare(
    base: dict[str, str], *, site_dirs: Sequence[Path] | None, cache_dir: Path | None
) -> WorkerBlas:
    if sys.platform == "darwin":
        return WorkerBlas(None, "accelerate", "macOS: MLX uses Accelerate")
    if not sys.platform.startswith("linux"):
        return WorkerBlas(None, "reference", f"no OpenBLAS recipe for {sys.platform}")

    roots = list(site_dirs) if site_dirs is not None else default_site_dirs()
    openblas = _first_existing(root / OPENBLAS_RELATIVE for root in roots)
    if openblas is None:
        return _fallback("cmeel-openblas not installed (no cmeel.prefix/lib/libopenblas.so.0)")

    links: list[tuple[str, Path]] = []
    bundled = _first_existing(root / MLX_BUNDLED_LIBS for root in roots)
    if bundled is not None:
        gfortran = sorted(bundled.glob("libgfortran-*.so*"))
        quadmath = sorted(bundled.glob("libquadmath-*.so*"))
        if gfortran:
            links.append(("libgfortran.so.5", gfortran[0]))
        # The mangled libgfortran asks for libquadmath by its own mangled name.
        links.extend((path.name, path) for path in quadmath)

    env = dict(base)
    if links:
        folder = _link_folder(links, cache_dir)
        env["LD_LIBRARY_PATH"] = _prepend(str(folder), base.get("LD_LIBRARY_PATH"), ":")
    # Without mlx's copy, a system libgfortran.so.5 may still satisfy OpenBLAS: let the probe say.
    env["LD_PRELOAD"] = _prepend(str(openblas), base.get("LD_PRELOAD"), " ")

    key = (sys.executable, env["LD_PRELOAD"], env.get("LD_LIBRARY_PATH", ""))
    with _verdicts_lock:
        if key not in _verdicts:
            _verdicts[key] = _probe(env)
        ok, detail = _verdicts[key]
    if not ok:
        return _fallback(f"OpenBLAS probe failed: {detail}")
    return WorkerBlas(env, "openblas", detail)


def _fallback(reason: str) -> WorkerBlas:
    log.info("the inference worker uses the reference BLAS: %s", reason)
    return WorkerBlas(None, "reference", reason)


def default_site_dirs() -> list[Path]:
    """Where pip puts packages for this interpreter: venv site-packages, user site, sys.path."""
    candidates: list[str] = []
    with contextlib.suppress(AttributeError):  # Some embedded interpreters lack it.
        candidates.extend(site.getsitepackages())
    if site.ENABLE_USER_SITE:
        candidates.append(site.getusersitepackages())
    candidates.extend(sys.path)
    seen: set[Path] = set()
    result: list[Path] = []
    for candidate in candidates:
        path = Path(candidate or ".").absolute()
        if path not in seen and path.is_dir():
            seen.add(path)
            result.append(path)
    return result


def probe_subprocess(env: Mapping[str, str] | None, timeout: float = PROBE_TIMEOUT_S) -> dict:
    """Run the matmul probe in a child with `env` (None: inherit) and return what it reports.

    Keys: `close` (matmul agrees with a BLAS-free product), `blas_libraries` (BLAS files mapped in
    the child), `openblas_config` (OpenBLAS's build string, None without OpenBLAS).
    """
    completed = subprocess.run(
        [sys.executable, "-c", _PROBE_SCRIPT],
        env=None if env is None else dict(env),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if completed.returncode != 0:
        tail = completed.stderr.strip().splitlines()[-3:]
        raise RuntimeError(f"probe exited with {completed.returncode}: {' | '.join(tail)}")
    return json.loads(completed.stdout.strip().splitlines()[-1])


def _probe(env: Mapping[str, str]) -> tuple[bool, str]:
    try:
        report = probe_subprocess(env)
    except (OSError, RuntimeError, ValueError, subprocess.TimeoutExpired) as error:
        return False, str(error)
    if not report.get("close"):
        return False, "matmul result differs from the reference"
    if not report.get("openblas_config"):
        return False, f"OpenBLAS not in use (BLAS libraries: {report.get('blas_libraries')})"
    return True, str(report["openblas_config"])


def _link_folder(links: Iterable[tuple[str, Path]], cache_dir: Path | None) -> Path:
    """A folder holding `name → target` symlinks, one per (venv, mlx build)."""
    links = list(links)
    digest = hashlib.sha256(
        "\n".join(f"{name}={target.resolve()}" for name, target in links).encode()
    ).hexdigest()[:16]
    parents = [cache_dir] if cache_dir is not None else [_user_cache_dir(), None]
    last_error: OSError | None = None
    for parent in parents:
        try:
            if parent is None:
                # Cache not writable (read-only home): a per-process folder still works.
                folder = Path(tempfile.mkdtemp(prefix="jupyter-lmsp-blas-"))
            else:
                folder = parent / digest
                folder.mkdir(parents=True, exist_ok=True)
            for name, target in links:
                _symlink(folder / name, target.resolve())
            return folder
        except OSError as error:
            last_error = error
    assert last_error is not None
    raise last_error


def _user_cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "jupyter-lmsp" / "blas-libs"


def _symlink(link: Path, target: Path) -> None:
    if link.is_symlink() and Path(os.readlink(link)) == target:
        return
    # Build under a unique name and rename over: concurrent workers never see a missing link.
    temporary = link.with_name(f".{link.name}.{os.getpid()}.{threading.get_ident()}")
    temporary.unlink(missing_ok=True)
    temporary.symlink_to(target)
    os.replace(temporary, link)


def _first_existing(paths: Iterable[Path]) -> Path | None:
    return next((path for path in paths if path.exists()), None)


def _prepend(item: str, existing: str | None, separator: str) -> str:
    parts = [part for part in (existing or "").split(separator) if part and part != item]
    return separator.join([item, *parts])
