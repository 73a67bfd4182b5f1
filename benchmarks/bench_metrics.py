"""What the Prometheus metrics cost (issue 18): the same measurements against a server with
metrics on and one with them off (`--LMSPExtension.metrics=False`), side by side in one run.

    .venv/bin/python benchmarks/bench_metrics.py [--rounds 5] [--tokens 64] [--model demo|tiny]

1. Single-stream tok/s: one streamed response, decode = (tokens − 1) / (last delta − first
   delta), end-to-end = tokens / (last delta − request sent).
2. 8-stream aggregate tok/s: eight streamed responses at once, all tokens / wall time.
3. Background create → 202: p50 (and p99) of sequential POSTs. On a second pair of servers
   whose worker holds one slow task, so the others stay queued and the create path alone is
   timed (as in bench_control_plane.py).

On and off alternate within every round (which goes first alternates too), so both meet the
same machine; the median over rounds is reported with the difference (target: within 2%).
Every prompt is new to its server (no prompt-cache hits); both modes get the same prompts
in a round, so both generate the same text (greedy) with the same speculative drafts. Results: benchmarks/results/metrics.md (and .json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from serverproc import ServerProcess  # noqa: E402

from jupyter_lmsp.models.testmodel import make_test_model  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
MODES = ("on", "off")


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def model_dir(kind: str, base: Path) -> Path:
    if kind == "tiny":
        path = base / "tiny-model"
        make_test_model(path)
        return path
    from jupyter_lmsp.models.demo import _default_model_dir, ensure_demo_model

    return ensure_demo_model(_default_model_dir())


def start(base: Path, name: str, model: Path, metrics: bool, **traits: Any) -> ServerProcess:
    data = base / name
    (data / "models").mkdir(parents=True)
    (data / "models" / "bench").symlink_to(model)
    server = ServerProcess(
        data, default_model="bench", name=name, metrics=metrics, blas_threads=1, **traits
    )
    return server.start()


def stream_one(server: ServerProcess, prompt: str, tokens: int) -> tuple[int, float, float, float]:
    """One streamed response: (output tokens, sent, first delta, last delta) in perf seconds."""
    body = {"input": prompt, "stream": True, "max_output_tokens": tokens, "temperature": 0}
    first = last = 0.0
    out = 0
    with server.client() as c:
        sent = time.perf_counter()
        with c.stream("POST", "/responses", json=body) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                event = json.loads(line[6:])
                if event["type"] == "response.output_text.delta":
                    last = time.perf_counter()
                    first = first or last
                elif event["type"] in ("response.completed", "response.incomplete"):
                    out = event["response"]["usage"]["output_tokens"]
    return out, sent, first, last


def single(server: ServerProcess, prompt: str, tokens: int) -> tuple[float, float]:
    """(decode tok/s, end-to-end tok/s); decode is NaN when every token came in one delta."""
    n, sent, first, last = stream_one(server, prompt, tokens)
    decode = (n - 1) / (last - first) if n > 1 and last > first else float("nan")
    return decode, n / (last - sent)


def concurrent(server: ServerProcess, prompts: list[str], tokens: int) -> float:
    results: list[tuple[int, float, float, float]] = []
    threads = [
        threading.Thread(target=lambda p=p: results.append(stream_one(server, p, tokens)))
        for p in prompts
    ]
    begun = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ended = max(r[3] for r in results)
    return sum(r[0] for r in results) / (ended - begun)


def creates(server: ServerProcess, n: int) -> list[float]:
    body = {"input": "hi", "background": True, "max_output_tokens": 1, "temperature": 0}
    out = []
    with server.client() as c:
        for _ in range(n):
            t = time.perf_counter()
            r = c.post("/responses", json=body)
            out.append((time.perf_counter() - t) * 1000)
            assert r.status_code == 202, r.text
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64, help="output tokens per stream")
    parser.add_argument("--streams", type=int, default=8, help="concurrent streams")
    parser.add_argument("--creates", type=int, default=200, help="creates per round and mode")
    parser.add_argument("--model", choices=("demo", "tiny"), default="demo")
    parser.add_argument("--out", type=Path, default=RESULTS / "metrics")
    args = parser.parse_args()

    base = Path(tempfile.mkdtemp(prefix="lmsp-bench-metrics-"))
    model = model_dir(args.model, base)
    samples: dict[str, dict[str, list[float]]] = {
        m: {"single": [], "single_e2e": [], "aggregate": [], "create_p50": [], "create_p99": []}
        for m in MODES
    }
    log(f"generation: two servers (metrics on, off), model {model.name}")
    servers = {m: start(base, f"gen-{m}", model, m == "on", max_batch_size=8) for m in MODES}
    try:
        for m in MODES:  # warm up: worker started, model loaded
            single(servers[m], f"Warm up {m}.", 8)
        for round_ in range(args.rounds):
            order = MODES if round_ % 2 == 0 else MODES[::-1]
            for m in order:
                # The same prompts for both modes (each server has its own prompt cache): a
                # different text would change how many speculative drafts are accepted, which
                # moves tok/s by more than the metrics cost.
                prompt = f"Round {round_}: tell me about the sea."
                decode, e2e = single(servers[m], prompt, args.tokens)
                samples[m]["single"].append(decode)
                samples[m]["single_e2e"].append(e2e)
                prompts = [
                    f"Round {round_}, stream {i}: describe a city." for i in range(args.streams)
                ]
                samples[m]["aggregate"].append(concurrent(servers[m], prompts, args.tokens))
                log(
                    f"round {round_} {m}: single {samples[m]['single'][-1]:.2f} tok/s, "
                    f"{args.streams} streams {samples[m]['aggregate'][-1]:.2f} tok/s"
                )
    finally:
        for s in servers.values():
            s.stop()
    log("creates: two servers whose worker holds one slow task")
    slow = {"max_batch_size": 1, "engine_token_delay": 60}
    servers = {m: start(base, f"create-{m}", model, m == "on", **slow) for m in MODES}
    try:
        for m in MODES:
            creates(servers[m], 20)  # warm up connections and code paths
        for round_ in range(args.rounds):
            order = MODES if round_ % 2 == 0 else MODES[::-1]
            for m in order:
                times = creates(servers[m], args.creates)
                samples[m]["create_p50"].append(pct(times, 0.5))
                samples[m]["create_p99"].append(pct(times, 0.99))
                log(f"round {round_} {m}: create → 202 p50 {samples[m]['create_p50'][-1]:.2f} ms")
    finally:
        for s in servers.values():
            s.stop()

    rows = [
        ("single-stream decode tok/s", "single", True),
        ("single-stream end-to-end tok/s", "single_e2e", True),
        (f"{args.streams}-stream aggregate tok/s", "aggregate", True),
        ("create → 202 p50 ms", "create_p50", False),
        ("create → 202 p99 ms", "create_p99", False),
    ]
    table = []
    for label, key, higher_is_better in rows:
        on = statistics.median(samples["on"][key])
        off = statistics.median(samples["off"][key])
        # The cost of metrics, in percent: positive = slower with metrics on.
        cost = ((off - on) / off if higher_is_better else (on - off) / off) * 100
        per_round = [
            ((f - o) / f if higher_is_better else (o - f) / f) * 100
            for o, f in zip(samples["on"][key], samples["off"][key], strict=True)
        ]
        table.append(
            {
                "what": label,
                "on": on,
                "off": off,
                "cost_percent": cost,
                "cost_min": min(per_round),
                "cost_max": max(per_round),
            }
        )
    meta = {
        "model": args.model,
        "rounds": args.rounds,
        "tokens": args.tokens,
        "streams": args.streams,
        "creates": args.creates,
        "cpus": os.cpu_count(),
        "load_before": os.getloadavg(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(
        json.dumps({"meta": meta, "samples": samples, "table": table}, indent=2)
    )
    lines = [
        "# Metrics on vs off",
        "",
        f"Model {args.model}, {args.rounds} rounds (median), {args.tokens} tokens per stream, "
        f"{args.creates} creates per round; {meta['cpus']} CPUs, load {meta['load_before']}.",
        "Cost: how much worse with metrics on (target ≤ 2%).",
        "",
        "Same prompts for both modes within a round; per-round cost = the round's on vs off.",
        "",
        "| what | metrics on | metrics off | cost (medians) | cost per round (min – max) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for row in table:
        lines.append(
            f"| {row['what']} | {row['on']:.2f} | {row['off']:.2f} | {row['cost_percent']:+.1f}% "
            f"| {row['cost_min']:+.1f}% – {row['cost_max']:+.1f}% |"
        )
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
