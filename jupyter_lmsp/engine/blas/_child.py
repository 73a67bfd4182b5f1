"""The BLAS probe's child program: `python _child.py '{"threads": N, "repeats": R, "library": P}'`.

Started by `probe.py` with a candidate's environment (`LD_PRELOAD` of an OpenBLAS, or nothing
for mlx's bundled reference BLAS). It proves that MLX's float32 matmuls run and are right under
that environment, says which library served them and with how many threads, and times a
decode-like and a prefill-like matmul. It prints one JSON line; any crash (a SIGILL from a
library built for instructions this CPU lacks, a library that does not load) is the parent's to
report. Run as a file, not as a module of the package, so the child imports nothing but MLX.
"""

from __future__ import annotations

import ctypes
import json
import os
import statistics
import sys
import time
from typing import Any, cast

# SmolLM2-135M's shapes as `nn.Linear` applies them (x @ W.T): the tied output head for one
# decode step of a batch of 8, and one up projection of a 512-token prefill chunk.
DECODE = ((8, 576), (49152, 576))
PREFILL = ((512, 576), (1536, 576))
# The products are checked against an elementwise product, which no BLAS computes: on these
# rows/columns only, as the full elementwise product of the decode shape would need 900 MB.
CHECKED = 512


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def _process_symbol(name: str) -> Any:
    """A function from the process's global scope (where LD_PRELOAD puts its library), or None.

    mlx's own reference BLAS is loaded as a dependency of a Python extension module, i.e. in a
    local scope, so only a preloaded BLAS is found here.
    """
    try:
        return getattr(ctypes.CDLL(None), name)
    except AttributeError:
        return None


def _served_by(function: Any) -> str | None:
    """The file that defines `function` (dladdr)."""
    dladdr = _process_symbol("dladdr")
    if function is None or dladdr is None:
        return None
    info = _DlInfo()
    if not dladdr(ctypes.cast(function, ctypes.c_void_p), ctypes.byref(info)):
        return None
    return info.dli_fname.decode() if info.dli_fname else None


def _text(name: str) -> str | None:
    function = _process_symbol(name)
    if function is None:
        return None
    function.restype = ctypes.c_char_p
    value = function()
    return value.decode().strip() if value else None


def _threads(requested: int) -> dict[str, Any]:
    """What OpenBLAS says about its threads: from the environment, and after set_num_threads."""
    get = _process_symbol("openblas_get_num_threads")
    put = _process_symbol("openblas_set_num_threads")
    if get is None:
        return {"threads": None, "threads_after_set": None}
    get.restype = ctypes.c_int
    from_environment = int(get())
    after_set = None
    if put is not None and requested > 0:
        put.argtypes = [ctypes.c_int]
        put(requested)
        after_set = int(get())
        # Back to what the worker will run with: the environment's count is what is timed.
        put(from_environment)
    return {"threads": from_environment, "threads_after_set": after_set}


def main() -> None:
    params = json.loads(sys.argv[1])
    import mlx.core as mx

    mx.set_default_device(mx.cpu)
    report: dict[str, Any] = {
        "config": _text("openblas_get_config"),
        "corename": _text("openblas_get_corename"),
        "served_by": _served_by(_process_symbol("cblas_sgemm")),
        **_threads(int(params.get("threads") or 0)),
    }
    expected = params.get("library")
    if expected and (
        report["served_by"] is None
        or os.path.realpath(report["served_by"]) != os.path.realpath(expected)
    ):
        # The loader ignored or refused the preload: nothing to measure (the parent rejects it).
        print(json.dumps(report), flush=True)
        return

    def elementwise(a: Any, b: Any) -> Any:
        return (a[:, :, None] * b[None, :, :]).sum(axis=1)

    def normal(shape: tuple[int, int], seed: int) -> Any:
        return mx.random.normal(shape, key=mx.random.key(seed))

    # Odd sizes and both transpositions reach the edge kernels; the real shapes the main ones.
    a, b, w = normal((48, 40), 1), normal((40, 56), 2), normal((45, 40), 3)
    x_decode, w_decode = normal(DECODE[0], 4), normal(DECODE[1], 5)
    x_prefill, w_prefill = normal(PREFILL[0], 6), normal(PREFILL[1], 7)
    mx.eval(a, b, w, x_decode, w_decode, x_prefill, w_prefill)
    checks = [
        (a @ b, elementwise(a, b)),
        (a @ w.T, elementwise(a, w.T)),
        ((x_decode @ w_decode.T)[:, :CHECKED], elementwise(x_decode, w_decode[:CHECKED].T)),
        ((x_prefill @ w_prefill.T)[:8], elementwise(x_prefill[:8], w_prefill.T)),
    ]
    # .item() of a float32 array is a Python float; mlx's stub says any scalar.
    errors = [cast(float, mx.abs(got - want).max().item()) for got, want in checks]
    report["correct"] = all(
        mx.allclose(got, want, rtol=1e-3, atol=1e-3).item() for got, want in checks
    )
    report["max_error"] = max(errors)

    def timed(x: Any, weight: Any) -> list[float]:
        mx.eval(x @ weight.T)  # warm-up: first-call allocations and thread start-up
        samples = []
        for _ in range(int(params.get("repeats") or 5)):
            start = time.perf_counter()
            mx.eval(x @ weight.T)
            samples.append((time.perf_counter() - start) * 1000)
        return samples

    decode, prefill = timed(x_decode, w_decode), timed(x_prefill, w_prefill)
    report["decode_ms"], report["prefill_ms"] = (
        statistics.median(decode),
        statistics.median(prefill),
    )
    report["samples_ms"] = {"decode": decode, "prefill": prefill}
    with open("/proc/self/maps") as maps:
        report["blas_libraries"] = sorted(
            {line.split()[-1] for line in maps if "blas" in line.rsplit("/", 1)[-1]}
        )
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
