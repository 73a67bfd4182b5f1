"""The decode ceiling: how long one forward step of the demo model takes, with no server at all.

    .venv/bin/python benchmarks/bench_forward.py [--threads 1 2] [--batch 1 4 8]

Every server that decodes N streams together on this machine pays at least one forward pass of
N tokens per step, so N / step time is the most tokens/s any of them can reach, whatever its
scheduling. This measures that step (the model on mlx-lm's `BatchKVCache`, greedy, pipelined the way
mlx-lm's decoders run it, the context growing from 100 tokens), and separately the time the
weight matmuls alone take, for each OpenBLAS thread count, with the BLAS the service's worker
would get (`jupyter_lmsp.engine.blas.choose_blas`; `--blas-coretype Haswell` masks AVX-512).

Writes `benchmarks/results/forward.md` (and `.json`). Compare it with `engine.md`: at 8 streams
`mlx_lm.server` already reaches most of the ceiling, which bounds the ratio any server can reach
over it on this machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DEFAULT_MODEL_DIR = Path.home() / ".cache" / "jupyter-lmsp" / "models"
CONTEXT = 100
STEPS = 40
# The prefill measured: each sequence's prompt continues a cached prefix (the system prompt),
# as in the engine benchmark's concurrent rounds: ~28 cached tokens, then ~15 new ones, of
# which all but the last are prefilled (the last goes through the first decode step).
PREFIX = 28
NEW_TOKENS = 15


def measure(model_path: str, batch: int) -> dict[str, float]:
    """In this process (started with the BLAS environment): step and matmul times, in ms."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import BatchKVCache

    model, _ = load(model_path)
    cache = [BatchKVCache([0] * batch) for _ in model.layers]
    mx.eval(model(mx.random.randint(0, 1000, (batch, CONTEXT)), cache=cache))
    token = mx.random.randint(0, 1000, (batch, 1))

    def decode(steps: int) -> None:
        # As mlx-lm's decoders do: the next step is queued (async_eval) before the current
        # one's tokens are waited for, so building the graph overlaps the compute.
        nonlocal token
        current = model(token, cache=cache)[:, -1, :].argmax(axis=-1)
        mx.async_eval(current)
        for _ in range(steps):
            following = model(current[:, None], cache=cache)[:, -1, :].argmax(axis=-1)
            mx.async_eval(following)
            mx.eval(current)
            current = following
        mx.eval(current)
        token = current[:, None]

    # Every weight matrix once, as `Linear` applies it (x @ W.T), plus the tied output head.
    weights = [m.weight for _, m in model.named_modules() if type(m).__name__ == "Linear"]
    weights.append(model.model.embed_tokens.weight)
    inputs = {w.shape[1]: mx.random.normal((batch, w.shape[1])) for w in weights}
    mx.eval(list(inputs.values()))

    def matmuls() -> None:
        mx.eval([inputs[w.shape[1]] @ w.T for w in weights])

    def prefill() -> float:
        fresh = [BatchKVCache([0] * batch) for _ in model.layers]
        model(mx.random.randint(0, 1000, (batch, PREFIX)), cache=fresh)
        mx.eval([c.state for c in fresh])
        new = mx.random.randint(0, 1000, (batch, NEW_TOKENS - 1))
        mx.eval(new)
        started = time.perf_counter()
        # As mlx-lm's BatchGenerator prefills: only the caches are evaluated (no logits).
        model(new, cache=fresh)
        mx.eval([c.state for c in fresh])
        return (time.perf_counter() - started) * 1000

    result = {}
    prefill()
    result["prefill_ms"] = sorted(prefill() for _ in range(3))[1]
    decode(3)
    started = time.perf_counter()
    decode(STEPS)
    result["step_ms"] = (time.perf_counter() - started) / (STEPS + 1) * 1000
    for _ in range(3):
        matmuls()
    started = time.perf_counter()
    for _ in range(STEPS):
        matmuls()
    result["matmul_ms"] = (time.perf_counter() - started) / STEPS * 1000
    return result


def measure_in_child(model_path: Path, env: dict[str, str], batch: int) -> dict[str, float]:
    """`measure` in a fresh process started with `env` (which picks its BLAS and threads)."""
    out = subprocess.run(
        [sys.executable, __file__, "--child", str(model_path), str(batch)],
        env=env,
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
    ).stdout
    measured: dict[str, float] = json.loads(out.strip().splitlines()[-1])
    return measured


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument(
        "--blas-coretype",
        default="",
        help="OPENBLAS_CORETYPE (e.g. Haswell: a DYNAMIC_ARCH OpenBLAS without AVX-512)",
    )
    parser.add_argument(
        "--blas-candidates", nargs="+", default=[], help="probe only these BLAS candidates"
    )
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "BATCH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child[0], int(args.child[1]))))
        return 0

    sys.path.insert(0, str(REPO))
    from jupyter_lmsp.engine.blas import choose_blas
    from jupyter_lmsp.models.demo import ensure_demo_model

    model = ensure_demo_model(args.model_dir)
    rows: list[dict[str, Any]] = []
    choices = {}
    for threads in args.threads:
        # The BLAS the service's worker would get with this many threads (probed, cached).
        blas = choices[threads] = choose_blas(
            threads=threads, coretype=args.blas_coretype, only=args.blas_candidates
        )
        print(f"threads={threads}: BLAS {blas.name} ({blas.reason})", file=sys.stderr)
        for batch in args.batch:
            env = blas.worker_environment()
            row = {"threads": threads, "batch": batch, **measure_in_child(model, env, batch)}
            row["ceiling_tps"] = batch / row["step_ms"] * 1000
            rows.append(row)
            print(
                f"threads={threads} batch={batch}: step {row['step_ms']:.1f} ms "
                f"(matmuls {row['matmul_ms']:.1f} ms), ceiling {row['ceiling_tps']:.1f} tok/s, "
                f"prefill {row['prefill_ms']:.0f} ms",
                file=sys.stderr,
            )
    meta = {
        "model": model.name,
        "blas": {str(t): c.report() for t, c in choices.items()},
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "context": CONTEXT,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "when": time.strftime("%Y-%m-%d %H:%M"),
        "load_after": os.getloadavg(),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "forward.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [
        "# Decode ceiling: one forward step, no server",
        "",
        f"`benchmarks/bench_forward.py`, {meta['when']}. Model `{model.name}` (float32), "
        "BLAS "
        + ", ".join(f"{c.name} ({c.config or 'mlx bundled'})" for c in choices.values())
        + f", context {CONTEXT}–{CONTEXT + STEPS + 4} tokens, {meta['cpus']} CPUs, "
        f"load average {meta['load_after'][0]:.1f} after.",
        "",
        "| OpenBLAS threads | batch | step (ms) | of it, weight matmuls (ms) | ceiling (tok/s) "
        f"| prefill, {NEW_TOKENS - 1} new tokens each (ms) |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['threads']} | {r['batch']} | {r['step_ms']:.1f} | {r['matmul_ms']:.1f} "
            f"| {r['ceiling_tps']:.1f} | {r['prefill_ms']:.0f} |"
        )
    lines += [
        "",
        "Ceiling = batch / step time: the most tokens/s any server decoding that many streams "
        "together can reach here, before any prefill, scheduling, HTTP or storage. Prefill = "
        f"{NEW_TOKENS - 1} new prompt tokens of every sequence after a {PREFIX}-token cached "
        "prefix, caches evaluated, no logits (as mlx-lm's BatchGenerator prefills).",
    ]
    (args.out / "forward.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out / 'forward.md'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
