"""Event-loop stalls with one server and with two servers on one data folder (issue 16).

    .venv/bin/python benchmarks/bench_multi_server.py [--quick] [--streams 8] [--creates 200]

Each server runs the same work at once: `--streams` streamed responses (`stream: true`, read to
the end) and `--creates` background creates from 4 client threads. Each server measures its own
event loop (`LMSPExtension.loop_watch_path`: the gaps between timer callbacks asked for every
5 ms, the longest and the 99th percentile of each second); the table gives, per server, the
worst gap and the worst per-second p99 during the work, first for one server alone, then for
two servers sharing one SQLite database (each one's write lock is the other's wait: the
runner's commits, heartbeats and sweeps must wait off the loop).

Results go to benchmarks/results/multi_server.md (and .json); `--quick` only prints them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from serverproc import ServerProcess  # noqa: E402

from jupyter_lmsp.models.testmodel import make_test_model  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def prepare_data_dir(base: Path) -> Path:
    (base / "models").mkdir(parents=True)
    make_test_model(base / "models" / "tiny")
    return base


def work(server: ServerProcess, streams: int, creates: int, tokens: int) -> dict:
    """`streams` streamed responses and `creates` background creates, all at once."""
    errors: list[str] = []
    latencies: list[float] = []
    lock = threading.Lock()

    def stream() -> None:
        body = {"input": "Tell me a story.", "stream": True, "max_output_tokens": tokens}
        try:
            with (
                httpx.Client(base_url=server.api, headers=server.headers, timeout=600) as c,
                c.stream("POST", "/responses", json=body) as r,
            ):
                for line in r.iter_lines():
                    if line.startswith("data: ") and '"response.completed"' in line:
                        break
                    if line.startswith("data: ") and '"response.incomplete"' in line:
                        break
        except Exception as e:  # reported in the results
            errors.append(repr(e))

    def create(n: int) -> None:
        body = {"input": "hi", "background": True, "max_output_tokens": 2, "temperature": 0}
        with httpx.Client(base_url=server.api, headers=server.headers, timeout=120) as c:
            for _ in range(n):
                t = time.perf_counter()
                r = c.post("/responses", json=body)
                with lock:
                    latencies.append((time.perf_counter() - t) * 1000)
                if r.status_code != 202:
                    errors.append(f"create: {r.status_code}")

    threads = [threading.Thread(target=stream) for _ in range(streams)]
    threads += [threading.Thread(target=create, args=(creates // 4,)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    latencies.sort()
    return {
        "errors": errors,
        "create_p50_ms": latencies[len(latencies) // 2] if latencies else None,
        "create_p99_ms": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
        if latencies
        else None,
    }


def stalls(path: Path, start: float, end: float) -> dict:
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    window = [x for x in lines if start <= x["time"] <= end + 1.0]
    return {
        "worst_gap_ms": max((x["max_ms"] for x in window), default=None),
        "worst_p99_ms": max((x["p99_ms"] for x in window), default=None),
        "seconds": len(window),
    }


def run(base: Path, n_servers: int, streams: int, creates: int, tokens: int) -> list[dict]:
    data = prepare_data_dir(base / f"{n_servers}-servers")
    servers = [
        ServerProcess(
            data,
            name=f"s{i}",
            engine_token_delay=0.02,
            loop_watch_path=str(data / f"loop-s{i}.jsonl"),
        ).start()
        for i in range(n_servers)
    ]
    try:
        time.sleep(2.0)  # past start-up (model load, the heap freeze)
        start = time.time()
        results: list[dict] = [{} for _ in servers]
        threads = [
            threading.Thread(
                target=lambda i, s: results[i].update(work(s, streams, creates, tokens)),
                args=(i, s),
            )
            for i, s in enumerate(servers)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        end = time.time()
        time.sleep(1.2)  # the last second's line
        for i, _ in enumerate(servers):
            results[i].update(stalls(data / f"loop-s{i}.jsonl", start, end))
            results[i]["work_seconds"] = end - start
        return results
    finally:
        for s in servers:
            s.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="smaller counts, for a smoke run")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--creates", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    streams, creates, tokens = args.streams, args.creates, args.tokens
    if args.quick:
        streams, creates, tokens = 2, 20, 16
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        print("1/2 one server…", file=sys.stderr)
        single = run(base, 1, streams, creates, tokens)
        print("2/2 two servers on one data folder…", file=sys.stderr)
        double = run(base, 2, streams, creates, tokens)
    results = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "when": time.strftime("%Y-%m-%d %H:%M"),
        "work": {"streams": streams, "creates": creates, "tokens": tokens},
        "one_server": single,
        "two_servers": double,
    }

    def row(label: str, r: dict) -> str:
        return (
            f"| {label} | {r['worst_gap_ms']:.1f} ms | {r['worst_p99_ms']:.1f} ms "
            f"| {r['create_p50_ms']:.1f} ms | {r['create_p99_ms']:.1f} ms "
            f"| {r['work_seconds']:.1f} s | {len(r['errors'])} |"
        )

    table = f"""# Event-loop stalls, one server and two servers on one data folder

{results["machine"]}, {results["when"]}. Command: `.venv/bin/python benchmarks/bench_multi_server.py{" --quick" if args.quick else ""}`.
Each server at once: {streams} streamed responses of {tokens} tokens and {creates} background
creates (4 client threads); the test model, a worker token delay of 20 ms.

| server | worst loop gap | worst p99 gap (per second) | create → 202 p50 | p99 | work took | errors |
| --- | --- | --- | --- | --- | --- | --- |
{row("one server alone", single[0])}
{row("two servers: first", double[0])}
{row("two servers: second", double[1])}
"""
    if not args.quick:  # a smoke run leaves the recorded results alone
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "multi_server.json").write_text(json.dumps(results, indent=2))
        (RESULTS / "multi_server.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
