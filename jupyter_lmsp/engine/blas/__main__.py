"""`python -m jupyter_lmsp.engine.blas`: the BLAS candidates, each one's probe and speed, the choice.

    python -m jupyter_lmsp.engine.blas [--threads N] [--coretype Haswell] [--only NAME ...]
                                       [--no-cache] [--json]

Without `--no-cache` a verdict cached by the server (same key) is shown as it is.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from . import blas_report
from .candidates import read_cpu


def default_threads() -> int:
    """The extension's default `blas_threads`: 1 on machines with 2 CPUs or fewer."""
    return 1 if (os.cpu_count() or 1) <= 2 else 0


def render(report: dict) -> str:
    rows = [
        (
            ("* " if c["chosen"] else "  ") + c["name"],
            c["verdict"],
            _ms(c["decode_ms"]),
            _ms(c["prefill_ms"]),
            "-" if c["threads"] is None else str(c["threads"]),
            c["corename"] or "-",
            c["reason"],
        )
        for c in report["candidates"]
    ]
    header = ("  candidate", "verdict", "decode ms", "prefill ms", "threads", "core", "reason")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(6)]
    lines = [
        "  ".join(cell.ljust(widths[i]) if i < 6 else cell for i, cell in enumerate(row))
        for row in [header, *rows]
    ]
    cpu = read_cpu()
    how = "cached verdict" if report["cached"] else f"probed in {report['probe_seconds']:.1f} s"
    lines += [
        "",
        f"CPU: {cpu.model}; AVX-512: {'yes' if cpu.avx512 else 'no'}",
        f"chosen: {report['name']} ({how})",
        f"  library: {report['paths']['library'] or '(mlx bundled)'}",
        f"  config: {report['config'] or '-'}",
        f"  threads: {report['threads']} (asked: {report['threads_requested']}), "
        f"OPENBLAS_CORETYPE: {report['coretype'] or '-'}",
        f"  why: {report['reason']}",
    ]
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--threads",
        type=int,
        default=default_threads(),
        help="OPENBLAS_NUM_THREADS, as LMSPExtension.blas_threads (default: the server's)",
    )
    parser.add_argument(
        "--coretype",
        default="",
        help="OPENBLAS_CORETYPE for DYNAMIC_ARCH builds (e.g. Haswell to mask AVX-512)",
    )
    parser.add_argument("--only", nargs="+", default=(), help="probe only these candidates")
    parser.add_argument("--no-cache", action="store_true", help="probe again, ignore the cache")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    report = blas_report(
        threads=args.threads,
        coretype=args.coretype,
        only=args.only,
        use_cache=not args.no_cache,
    )
    print(json.dumps(report, indent=1) if args.json else render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
