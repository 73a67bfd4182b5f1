"""Embeddings per second: the service's `POST /embeddings` against mlx-lm called directly.

    .venv/bin/python benchmarks/bench_embeddings.py [--rounds 5] [--inputs 32] [--batch 16]

On the demo model (SmolLM2-135M-Instruct, converted on first use), both on the BLAS the
service's probe chooses:

- **direct**: a child process that loads the model with `mlx_lm.load` and, for each request's
  batch, encodes the texts, runs `model.model(ids)` on the right-padded batch, mean-pools and
  normalises (what the service computes for a model without a pooling configuration);
- **service**: a real `jupyter server` with this extension; the same batches as
  `POST /lmsp/v1/embeddings` (base64, as the openai SDK asks), one after another
  (`sequential`), and the same requests from as many clients at once (`concurrent`).

Rounds are interleaved (direct then service, then service then direct, ...) so load changes
on the machine hit both alike. Per round and workload: embeddings/s of each and their ratio
service/direct; the summary gives the median ratio and its spread (min-max over the rounds).

Wall time swings with the load of a shared machine (other processes take the CPUs for a
while), so each round also measures CPU time per embedding, which that load barely moves: the
user+system seconds the direct process spent on a workload, and for the service those of the
server process and all its descendants (the inference worker) over the same requests (psutil,
read before and after). The CPU ratio is direct/service (above 1: the service spends less), so
it reads like the rate ratio; the target (>= 0.9x) is met only if it holds over the spread.
Writes `benchmarks/results/embeddings.md` and `embeddings.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import psutil

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
TOKEN = "bench-embeddings"
WORKLOADS = ("sequential", "concurrent")
WORDS = [
    "the",
    "model",
    "reads",
    "a",
    "notebook",
    "cell",
    "and",
    "writes",
    "a",
    "short",
    "summary",
    "of",
    "what",
    "the",
    "code",
    "does",
    "with",
    "its",
    "data",
    "frames",
    "plots",
    "and",
    "tests",
    "before",
    "the",
    "next",
    "cell",
    "runs",
    "on",
    "the",
    "same",
    "kernel",
]

CHILD = r"""
import json, sys, time
import numpy as np
import mlx.core as mx
from mlx_lm import load
model, tokenizer = load(sys.argv[1])
print("ready", flush=True)
for line in sys.stdin:
    batches = json.loads(line)
    start = time.perf_counter()
    count = 0
    for texts in batches:
        rows = [tokenizer.encode(t) for t in texts]
        longest = max(map(len, rows))
        ids = np.zeros((len(rows), longest), np.int32)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = r
        hidden = model.model(mx.array(ids)).astype(mx.float32)
        lengths = mx.array([len(r) for r in rows])
        inside = (mx.arange(longest)[None, :] < lengths[:, None])[..., None]
        pooled = (hidden * inside).sum(axis=1) / lengths[:, None]
        pooled = pooled / mx.linalg.norm(pooled, axis=1, keepdims=True)
        mx.eval(pooled)
        vectors = np.array(pooled)
        count += vectors.shape[0]
    print(json.dumps({"seconds": time.perf_counter() - start, "count": count}), flush=True)
"""


def cpu_seconds(pid: int) -> float:
    """User+system CPU seconds of process `pid` and of its live descendants so far."""
    root = psutil.Process(pid)
    total = 0.0
    for proc in [root, *root.children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue  # a helper that ended between the listing and the read
        total += times.user + times.system
    return total


class Measure:
    """One workload's embeddings per second (wall) and CPU seconds per embedding."""

    def __init__(self, count: int, wall: float, cpu: float) -> None:
        self.rate = count / wall
        self.cpu = cpu / count


def texts(n: int) -> list[str]:
    """n different texts of 12-36 words."""
    out = []
    for i in range(n):
        length = 12 + (i * 7) % 25
        out.append(" ".join(WORDS[(i + j) % len(WORDS)] for j in range(length)) + f" {i}")
    return out


class Direct:
    def __init__(self, model: Path, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(model)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, **env},
        )
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline().strip() == "ready"

    def run(self, batches: list[list[str]]) -> Measure:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        # Read around the exchange, as for the service: reading the batches and writing the
        # answer count too (a few microseconds).
        cpu = cpu_seconds(self.proc.pid)
        self.proc.stdin.write(json.dumps(batches) + "\n")
        self.proc.stdin.flush()
        result = json.loads(self.proc.stdout.readline())
        cpu = cpu_seconds(self.proc.pid) - cpu
        return Measure(result["count"], result["seconds"], cpu)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


class Service:
    def __init__(self, model: Path, data_dir: Path, traits: dict[str, Any]) -> None:
        sys.path.insert(0, str(REPO))
        from jupyter_lmsp.client.sandbox import LMSPServerProcess

        self.server = LMSPServerProcess(
            data_dir,
            token=TOKEN,
            default_model=model.name,
            traits={"model_dir": model.parent, **traits},
        ).start(timeout=180)
        self.client = httpx.Client(
            base_url=self.server.api, headers=self.server.headers, timeout=600
        )
        self.model = model.name

    def one(self, batch: list[str]) -> int:
        reply = self.client.post(
            "/embeddings",
            json={"model": self.model, "input": batch, "encoding_format": "base64"},
        )
        reply.raise_for_status()
        return len(reply.json()["data"])

    def run(self, batches: list[list[str]], clients: int = 1) -> Measure:
        assert self.server.proc is not None
        cpu = cpu_seconds(self.server.proc.pid)
        start = time.perf_counter()
        if clients == 1:
            count = sum(self.one(b) for b in batches)
        else:
            with ThreadPoolExecutor(clients) as pool:
                count = sum(pool.map(self.one, batches))
        wall = time.perf_counter() - start
        return Measure(count, wall, cpu_seconds(self.server.proc.pid) - cpu)

    def close(self) -> None:
        self.client.close()
        self.server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--inputs", type=int, default=32)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from jupyter_lmsp.engine.blas import REFERENCE, choose_blas
    from jupyter_lmsp.models.demo import ensure_demo_model

    model = ensure_demo_model(Path.home() / ".cache" / "jupyter-lmsp" / "models")
    blas = choose_blas(threads=1 if (os.cpu_count() or 1) <= 2 else 0)
    traits: dict[str, Any] = {} if blas.name == REFERENCE else {"blas_candidates": blas.name}
    items = texts(args.inputs)
    batches = [items[i : i + args.batch] for i in range(0, len(items), args.batch)]
    env = blas.worker_environment()
    # The thread count the service gives its worker (one BLAS thread on 2 CPUs or fewer).
    threads = 1 if (os.cpu_count() or 1) <= 2 else 0
    if threads:
        env["OPENBLAS_NUM_THREADS"] = str(threads)
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    direct = Direct(model, env)
    with tempfile.TemporaryDirectory() as tmp:
        service = Service(model, Path(tmp), traits)
        try:
            service.run(batches[:1])  # the worker loads the model
            direct.run(batches[:1])
            rounds: list[dict[str, float]] = []
            for r in range(args.rounds):
                row: dict[str, float] = {"load": os.getloadavg()[0]}
                order = ("direct", "service") if r % 2 == 0 else ("service", "direct")
                for side in order:
                    measured = (
                        {"direct": direct.run(batches)}
                        if side == "direct"
                        else {
                            "sequential": service.run(batches),
                            "concurrent": service.run(batches, clients=len(batches)),
                        }
                    )
                    for name, m in measured.items():
                        row[name] = m.rate
                        row[f"{name}_cpu_ms"] = m.cpu * 1000
                rounds.append(row)
                print(json.dumps(row), flush=True)
        finally:
            service.close()
            direct.close()
    summary = {}
    for workload in WORKLOADS:
        rate = [row[workload] / row["direct"] for row in rounds]
        # direct CPU / service CPU per embedding: above 1, the service spends less.
        cpu = [row["direct_cpu_ms"] / row[f"{workload}_cpu_ms"] for row in rounds]
        summary[workload] = {
            "median": statistics.median(rate),
            "min": min(rate),
            "max": max(rate),
            "rates": [row[workload] for row in rounds],
            "cpu_median": statistics.median(cpu),
            "cpu_min": min(cpu),
            "cpu_max": max(cpu),
        }
    command = ".venv/bin/python benchmarks/bench_embeddings.py " + " ".join(sys.argv[1:])
    RESULTS.mkdir(exist_ok=True)
    meta = {
        "command": command.strip(),
        "blas": blas.name,
        "cpus": os.cpu_count(),
        "inputs": args.inputs,
        "batch": args.batch,
        "started": started,
        "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    (RESULTS / "embeddings.json").write_text(
        json.dumps({"meta": meta, "rounds": rounds, "summary": summary}, indent=2) + "\n"
    )
    report = render(meta, rounds, summary, len(batches))
    (RESULTS / "embeddings.md").write_text(report)
    print(report)


def render(
    meta: dict[str, Any],
    rounds: list[dict[str, float]],
    summary: dict[str, dict[str, Any]],
    clients: int,
) -> str:
    """The results file: a wall-clock table and a CPU-time table of the same rounds, and the
    medians with their spread. Its conclusion is written by hand below the generated part."""
    lines = [
        "# Embeddings: service vs mlx-lm directly (demo model)",
        "",
        f"`{meta['command']}` — {meta['started']} to {meta['finished'][-8:]}, {meta['cpus']} CPUs, BLAS {meta['blas']}, "
        f"{meta['inputs']} texts of 12-36 words in requests of {meta['batch']}.",
        "",
        "Embeddings per second (wall clock):",
        "",
        f"| round | load | direct /s | service sequential /s | ratio | service {clients} "
        "clients /s | ratio |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for i, row in enumerate(rounds):
        lines.append(
            f"| {i + 1} | {row['load']:.1f} | {row['direct']:.1f} | {row['sequential']:.1f} | "
            f"{row['sequential'] / row['direct']:.2f} | {row['concurrent']:.1f} | "
            f"{row['concurrent'] / row['direct']:.2f} |"
        )
    lines += [
        "",
        "CPU milliseconds per embedding (direct: its process; service: the server process and "
        "its descendants), same rounds; ratio = direct / service:",
        "",
        f"| round | direct ms | service sequential ms | ratio | service {clients} clients ms "
        "| ratio |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for i, row in enumerate(rounds):
        lines.append(
            f"| {i + 1} | {row['direct_cpu_ms']:.1f} | {row['sequential_cpu_ms']:.1f} | "
            f"{row['direct_cpu_ms'] / row['sequential_cpu_ms']:.2f} | "
            f"{row['concurrent_cpu_ms']:.1f} | "
            f"{row['direct_cpu_ms'] / row['concurrent_cpu_ms']:.2f} |"
        )
    lines.append("")
    for workload, s in summary.items():
        lines.append(
            f"- {workload}: rate service/direct median {s['median']:.2f}x "
            f"(min {s['min']:.2f}, max {s['max']:.2f}); CPU direct/service median "
            f"{s['cpu_median']:.2f}x (min {s['cpu_min']:.2f}, max {s['cpu_max']:.2f})"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
