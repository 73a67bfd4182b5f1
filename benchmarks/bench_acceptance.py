"""How often proposed tokens are accepted, by the length of the n-gram match that proposed them.

The measurement behind `speculative.DEFAULT_ACCEPTANCE_PRIOR` (a new row's chance of acceptance
before its own verifies say otherwise). One command, on the demo model:

    .venv/bin/python benchmarks/bench_acceptance.py

It runs the engine's scheduler in a child process with the worker's BLAS (`choose_blas`, as the
service does), one generation at a time, greedy, on `bench_speculative.py`'s prompts: every
summarise/question task about its ~480-token text (grounded), every edit of it (edit) and every
story (open-ended). Speculation is forced to verify on every step as wide as the proposal goes
(a cost model where every step costs the same), so every proposal is verified and counted,
whatever the cost model would have chosen. Per workload and n-gram length: tokens proposed,
accepted, the verifies that rejected one, and the chance `Acceptance` estimates,
accepted / (accepted + rejected): the chance a proposed token is accepted given that the ones
before it were. Counts, not timings: the same on any machine for the same model and mlx.

Writes `benchmarks/results/acceptance.md` and `acceptance.json` (`--out`). Options: `--help`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench_engine import cli_flags, log, model_and_blas
from bench_speculative import DEFAULT_MODEL_DIR, EDITS, GROUNDED, OPEN, edit, grounded, open_ended

HERE = Path(__file__).resolve().parent
WORKLOADS = {
    "grounded": (grounded, len(GROUNDED)),
    "edit": (edit, len(EDITS)),
    "open-ended": (open_ended, len(OPEN)),
}


def child(model_path: str, tokens: int) -> None:
    """In a child with the worker's BLAS: every prompt, one at a time; counts as JSON."""
    from mlx_lm import load

    from jupyter_lmsp.engine.batching import BatchScheduler
    from jupyter_lmsp.engine.messages import GenerateJob
    from jupyter_lmsp.engine.prompt_cache import PromptCache
    from jupyter_lmsp.engine.speculative import SpeculationSettings
    from jupyter_lmsp.engine.worker import encode_chat

    model, tokenizer = load(model_path)
    # Every step verifies, as wide as the proposals go: every step costs the same to it.
    always = SpeculationSettings(verify_cost=(0.0, 0.0), sync_cost=0.0, learn_costs=False)
    out: dict[str, Any] = {}
    for name, (make, count) in WORKLOADS.items():
        sched = BatchScheduler(PromptCache(0), speculation=always, max_batch_size=1)
        for task in range(count):
            messages = make(task, "acceptance")
            job = GenerateJob(
                job_id=f"{name}-{task}", model_path="", messages=messages, max_tokens=tokens
            )
            sched.add(job, "m", model, tokenizer, encode_chat(tokenizer, messages), None)
            while sched.active:
                sched.step()
            print(f"{name} {task + 1}/{count} done", file=sys.stderr, flush=True)
        stats = sched.speculation_stats()
        out[name] = {str(n): list(c) for n, c in sorted(stats.by_ngram.items())}
    print(json.dumps(out))


def render(args: argparse.Namespace, counts: dict[str, Any], started: str) -> str:
    from jupyter_lmsp.engine.speculative import SpeculationSettings

    settings = SpeculationSettings()
    flags = " ".join(cli_flags(vars(args)))
    lines = [
        "# Acceptance by matched n-gram length",
        "",
        f"`benchmarks/bench_acceptance.py {flags}`, {started}. Demo model, "
        f"greedy, at most {args.tokens} tokens per generation, one generation at a time, every "
        "step verifying the whole proposal (up to 8 tokens). *Chance*: accepted / (accepted + "
        "verifies that rejected one), the chance a proposed token is kept given the ones "
        "before it were; *prior*: `SpeculationSettings.prior_chance` (a new row's estimate).",
        "",
        "| workload | n-gram | proposed | accepted | rejecting verifies | chance | prior |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, by_ngram in counts.items():
        for n, (proposed, accepted, rejected) in by_ngram.items():
            chance = accepted / max(1, accepted + rejected)
            lines.append(
                f"| {name} | {n} | {proposed} | {accepted} | {rejected} | {chance:.2f} | "
                f"{settings.prior_chance(int(n)):.2f} |"
            )
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--tokens", type=int, default=160, help="output tokens per generation")
    parser.add_argument("--blas-threads", type=int, default=1, help="OPENBLAS_NUM_THREADS")
    parser.add_argument("--blas-coretype", default="", help="OPENBLAS_CORETYPE")
    parser.add_argument("--blas-candidates", nargs="+", default=[])
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child[0], int(args.child[1]))
        return 0
    started = time.strftime("%Y-%m-%d %H:%M")
    model, blas = model_and_blas(args)  # puts this checkout first on sys.path
    log(f"model {model}; BLAS {blas.name}")
    done = subprocess.run(
        [sys.executable, __file__, "--child", str(model), str(args.tokens)],
        env=blas.worker_environment(),
        check=True,
        stdout=subprocess.PIPE,
        text=True,
    )
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    args.child = None
    report = render(args, counts, started)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "acceptance.md").write_text(report)
    meta = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    (args.out / "acceptance.json").write_text(
        json.dumps({"args": meta, "blas": blas.name, "by_ngram": counts}, indent=1)
    )
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
