"""The BLAS libraries an inference worker could preload instead of mlx's reference BLAS.

Found, in this order:

- `ngsolve-openblas` (PyPI, the default dependency on Linux x86-64): a DYNAMIC_ARCH OpenBLAS
  0.3.33 with the standard `cblas_*` names, picking its kernels for the CPU it runs on, as
  `ngsolve_openblas/libopenblasp-r<version>.so` in site-packages;
- a system OpenBLAS (Debian's `libopenblas0-pthread`/`-openmp`/`-serial` folders, and whatever
  `ldconfig -p` knows as `libopenblas*.so*`);
- `cmeel-openblas` (PyPI), where installed: a fixed SKYLAKEX build (`openblas_get_config()` says
  `OpenBLAS 0.3.31 NO_AFFINITY SKYLAKEX MAX_THREADS=4`) whose every matmul is an illegal
  instruction on a CPU without AVX-512, so it is only a candidate where `/proc/cpuinfo` lists the
  AVX-512 flags it was built for, and never when an `OPENBLAS_CORETYPE` is asked for (it would
  ignore it). It is no dependency: on an AVX-512 machine (AMD Zen 5) ngsolve-openblas picked
  its Cooperlake kernels and was as fast.

`scipy-openblas32`/`scipy-openblas64` (numpy's and scipy's wheels) are DYNAMIC_ARCH too, but
their symbols carry a `scipy_` prefix (`scipy_cblas_sgemm`), so preloading them replaces nothing
in mlx: they cannot serve.

The OpenBLAS wheels need `libgfortran.so.5`, which a fresh machine lacks. `mlx[cpu]` bundles a
copy under a mangled name (`mlx_cpu.libs/libgfortran-<hash>.so.5.0.0`, needing
`libquadmath-<hash>.so...`), so a private folder of symlinks (`libgfortran.so.5`, and the
libquadmath under its own name) on `LD_LIBRARY_PATH` satisfies the loader. A system OpenBLAS
gets the system's libgfortran from its package, and no such folder.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import os
import platform
import shutil
import site
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..usercache import user_cache_dir

REFERENCE = "reference"
NGSOLVE = "ngsolve-openblas"
CMEEL = "cmeel-openblas"
SYSTEM = "system-openblas"

NGSOLVE_GLOB = "ngsolve_openblas/libopenblas*.so*"
CMEEL_RELATIVE = Path("cmeel.prefix") / "lib" / "libopenblas.so.0"
MLX_BUNDLED_LIBS = "mlx_cpu.libs"
# Debian's three builds of libopenblas0 (one of them is the `libopenblas.so.0` alternative).
DEBIAN_OPENBLAS = [
    Path(f"/usr/lib/{platform.machine()}-linux-gnu/openblas-{variant}/libopenblas.so.0")
    for variant in ("pthread", "openmp", "serial")
]
# What a SKYLAKEX build of OpenBLAS executes: AVX-512 Foundation, CD, BW, DQ and VL.
AVX512_FLAGS = frozenset({"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"})


@dataclass(frozen=True)
class CpuInfo:
    """The CPU as `/proc/cpuinfo` describes it: what decides which kernels can run."""

    model: str
    flags: frozenset[str]
    machine: str = field(default_factory=platform.machine)

    @property
    def avx512(self) -> bool:
        return self.machine == "x86_64" and self.flags >= AVX512_FLAGS


def read_cpu(path: Path = Path("/proc/cpuinfo")) -> CpuInfo:
    model, flags = "", frozenset[str]()
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and not model:
                model = value.strip()
            elif key == "flags" and not flags:
                flags = frozenset(value.split())
    return CpuInfo(model or platform.processor() or "unknown", flags)


@dataclass(frozen=True)
class Candidate:
    """One BLAS to probe. `library` is None for mlx's reference BLAS (nothing preloaded).

    `env` holds the worker's variables for it besides the preload (`LD_LIBRARY_PATH` for the
    libgfortran links, `OPENBLAS_CORETYPE` for a variant); `skip` says why it is not probed.
    """

    name: str
    library: Path | None
    origin: str
    env: Mapping[str, str] = field(default_factory=dict)
    coretype: str | None = None
    skip: str | None = None

    def worker_env(self, base: Mapping[str, str]) -> dict[str, str]:
        """The variables to add to `base` for a worker on this BLAS (prepending to paths)."""
        env: dict[str, str] = {}
        for name, value in self.env.items():
            if name == "LD_LIBRARY_PATH":
                env[name] = prepend(value, base.get(name), ":")
            else:
                env[name] = value
        if self.library is not None:
            env["LD_PRELOAD"] = prepend(str(self.library), base.get("LD_PRELOAD"), " ")
        if self.coretype:
            env["OPENBLAS_CORETYPE"] = self.coretype
        return env

    def fingerprint(self) -> list[object]:
        """What identifies this candidate's library for the verdict cache."""
        stat: list[object] = []
        if self.library is not None:
            try:
                info = self.library.resolve().stat()
                stat = [str(self.library.resolve()), info.st_size, info.st_mtime_ns]
            except OSError:
                stat = [str(self.library), None, None]
        return [self.name, stat, sorted(self.env.items()), self.coretype, self.skip]


def find_candidates(
    *,
    site_dirs: Sequence[Path] | None = None,
    system_libraries: Sequence[Path] | None = None,
    cpu: CpuInfo | None = None,
    coretype: str = "",
    only: Iterable[str] = (),
    links_dir: Path | None = None,
) -> list[Candidate]:
    """Every BLAS found here, the reference first; skipped ones carry their reason.

    `site_dirs` replaces the site-packages folders searched; `system_libraries` replaces the
    system OpenBLAS files (default: Debian's folders and `ldconfig -p`); `cpu` replaces
    `/proc/cpuinfo`; `coretype` is the `OPENBLAS_CORETYPE` asked for; `only` (names) keeps just
    those (the reference is always kept: every candidate is measured against it).
    """
    cpu = cpu or read_cpu()
    roots = list(site_dirs) if site_dirs is not None else default_site_dirs()
    wanted = set(only)
    found: list[Candidate] = []

    gfortran_env: dict[str, str] = {}
    links = gfortran_links(roots)
    if links:
        gfortran_env["LD_LIBRARY_PATH"] = str(link_folder(links, links_dir))

    for library in _glob_first(roots, NGSOLVE_GLOB):
        found.append(Candidate(NGSOLVE, library, _origin(NGSOLVE), gfortran_env))
        break

    seen: set[Path] = set()
    system = system_libraries if system_libraries is not None else _system_openblas()
    for library in system:
        real = library.resolve()
        if real in seen or not library.exists():
            continue
        seen.add(real)
        variant = library.parent.name.removeprefix("openblas-")
        name = f"{SYSTEM}-{variant}" if library.parent.name.startswith("openblas-") else SYSTEM
        if any(c.name == name for c in found):
            name = f"{name}-{len(seen)}"
        found.append(Candidate(name, library, f"system OpenBLAS ({library.name})"))

    cmeel = next(
        (root / CMEEL_RELATIVE for root in roots if (root / CMEEL_RELATIVE).exists()), None
    )
    if cmeel is not None:
        skip = None
        if coretype:
            skip = (
                f"OPENBLAS_CORETYPE={coretype} was asked for, and cmeel-openblas is a fixed "
                "SKYLAKEX build that ignores it"
            )
        elif cpu.machine == "x86_64" and not cpu.avx512:
            missing = " ".join(sorted(AVX512_FLAGS - cpu.flags))
            skip = (
                "built for SKYLAKEX (AVX-512) only, and this CPU lacks "
                f"{missing}: every matmul would be an illegal instruction"
            )
        found.append(Candidate(CMEEL, cmeel, _origin(CMEEL), gfortran_env, skip=skip))

    if wanted:
        found = [c for c in found if c.name in wanted]
    if coretype:
        found = [
            Candidate(c.name, c.library, c.origin, c.env, coretype, c.skip)
            if c.name != CMEEL
            else c
            for c in found
        ]
    reference = Candidate(REFERENCE, None, "the reference BLAS bundled with mlx[cpu]")
    return [reference, *found]


def _origin(distribution: str) -> str:
    try:
        return f"PyPI {distribution} {importlib.metadata.version(distribution)}"
    except importlib.metadata.PackageNotFoundError:
        return f"PyPI {distribution}"


def _glob_first(roots: Iterable[Path], pattern: str) -> Iterable[Path]:
    for root in roots:
        yield from sorted(root.glob(pattern))


def _system_openblas() -> list[Path]:
    """Debian's OpenBLAS folders, then what the dynamic loader's cache lists."""
    found = [path for path in DEBIAN_OPENBLAS if path.exists()]
    ldconfig = shutil.which("ldconfig") or next(
        (p for p in ("/sbin/ldconfig", "/usr/sbin/ldconfig") if os.path.exists(p)), None
    )
    if ldconfig is None:
        return found
    try:
        listing = subprocess.run(
            [ldconfig, "-p"], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return found
    for line in listing.splitlines():
        name, arrow, path = line.strip().partition(" => ")
        # Only this machine's word size: `(libc6,x86-64)` on x86-64.
        if arrow and name.startswith("libopenblas") and ".so" in name:
            if platform.machine() == "x86_64" and "x86-64" not in name:
                continue
            found.append(Path(path))
    return found


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


def gfortran_links(roots: Iterable[Path]) -> list[tuple[str, Path]]:
    """(link name, target) pairs that give OpenBLAS mlx's bundled libgfortran."""
    bundled = next(
        (root / MLX_BUNDLED_LIBS for root in roots if (root / MLX_BUNDLED_LIBS).is_dir()), None
    )
    if bundled is None:
        return []
    links: list[tuple[str, Path]] = []
    gfortran = sorted(bundled.glob("libgfortran-*.so*"))
    if gfortran:
        links.append(("libgfortran.so.5", gfortran[0]))
    # The mangled libgfortran asks for libquadmath by its own mangled name.
    links.extend((path.name, path) for path in sorted(bundled.glob("libquadmath-*.so*")))
    return links


def link_folder(links: Iterable[tuple[str, Path]], parent: Path | None = None) -> Path:
    """A folder holding `name → target` symlinks, one per (venv, mlx build)."""
    links = list(links)
    digest = hashlib.sha256(
        "\n".join(f"{name}={target.resolve()}" for name, target in links).encode()
    ).hexdigest()[:16]
    parents = [parent] if parent is not None else [user_cache_dir() / "blas-libs", None]
    last_error: OSError | None = None
    for folder_parent in parents:
        try:
            if folder_parent is None:
                # Cache not writable (read-only home): a per-process folder still works.
                folder = Path(tempfile.mkdtemp(prefix="jupyter-lmsp-blas-"))
            else:
                folder = folder_parent / digest
                folder.mkdir(parents=True, exist_ok=True)
            for name, target in links:
                _symlink(folder / name, target.resolve())
            return folder
        except OSError as error:
            last_error = error
    assert last_error is not None
    raise last_error


def _symlink(link: Path, target: Path) -> None:
    if link.is_symlink() and Path(os.readlink(link)) == target:
        return
    # Build under a unique name and rename over: concurrent workers never see a missing link.
    temporary = link.with_name(f".{link.name}.{os.getpid()}.{threading.get_ident()}")
    temporary.unlink(missing_ok=True)
    temporary.symlink_to(target)
    os.replace(temporary, link)


def prepend(item: str, existing: str | None, separator: str) -> str:
    parts = [part for part in (existing or "").split(separator) if part and part != item]
    return separator.join([item, *parts])
