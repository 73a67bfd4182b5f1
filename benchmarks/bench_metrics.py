"""What the Prometheus metrics cost (issue 18): the same measurements against a server with
metrics on and one with them off (`--LMSPExtension.metrics=False`), side by side in one run.

    .venv/bin/python benchmarks/bench_metrics.py --together [--control] [--rounds 5] [--pairs 4]
    .venv/bin/python benchmarks/bench_metrics.py --switch [--control] [--pairs 6]

1. Single-stream tok/s: one streamed response, decode = (tokens − 1) / (last delta − first
   delta), end-to-end = tokens / (last delta − request sent).
2. 8-stream aggregate tok/s: eight streamed responses at once, all tokens / wall time.
3. Background create → 202: p50 (and p99), one create at a time, alternating between the two
   servers request by request in ABBA order. On a second pair of servers whose worker holds
   one slow task, so the others stay queued and the create path alone is timed (as in
   bench_control_plane.py).
4. The Jupyter server process's own CPU time (from /proc) per output token and per create:
   where the metrics are kept, and independent of the machine's speed drift.

Each round has two legs, each with fresh servers: a pair for the generation, then a pair for the
creates, one with metrics on and one off, started on-first in one leg and off-first in the other.
In A/A runs (both off) the server of a pair started first answered creates ~2% slower (p50),
which one pair serving every round turned into a bias of every round; now a round meets both
orders, and each leg new processes with their own memory layout. Each round has `--pairs`
blocks per mode, half in each leg (the same prompts for both modes in a pair;
every prompt new to its server, so both generate the same text with the same speculative
drafts). With `--together` a pair's two blocks run on both servers at the same time, each phase
started together, so both meet the same moment of this VM (whose speed moves by 10-25% within
minutes); without it, one after the other in ABBA order (on, off, off, on, ...). A round's
figure for a mode pools its blocks (tokens / time, or the p50 of all its creates); the cost is
the median of the per-round costs, with their spread (target: within 2% over the whole spread).
`--pin` confines each server, with its worker, to a CPU of its own once warmed up (the
first-started to the first CPU: they swap CPUs between a round's legs), so the two servers do
not compete for cores and what a server's process spends is taken from its own worker.
`--control` runs both servers with metrics off (an A/A run: what two identical servers differ
by here). `--switch` uses one server per round instead of pairs, its metrics switched on or off
before each block (`metrics_switch.py`, a server extension of the benchmark's own), speculation
and the prompt cache off so a pair's blocks are the same work (`switch_round`). Results:
benchmarks/results/metrics.md (and .json).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import metrics_switch  # noqa: E402
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


def start(
    base: Path, name: str, model: Path, metrics: bool, switch: bool = False, **traits: Any
) -> ServerProcess:
    """A server of the bench model; with `switch`, one whose metrics the benchmark turns on and
    off while it runs (`metrics_switch`, loaded from benchmarks/)."""
    data = base / name
    (data / "models").mkdir(parents=True)
    (data / "models" / "bench").symlink_to(model)
    server = ServerProcess(
        data,
        default_model="bench",
        name=name,
        metrics=metrics,
        blas_threads=1,
        env={"PYTHONPATH": search_path(ROOT / "benchmarks")} if switch else None,
        options=["--ServerApp.jpserver_extensions=metrics_switch=True"] if switch else None,
        **traits,
    )
    return server.start()


def search_path(first: Path) -> str:
    """`first` ahead of the caller's own PYTHONPATH (kept: a checkout put there stays in use)."""
    return os.pathsep.join([str(first), *filter(None, [os.environ.get("PYTHONPATH")])])


def set_metrics(server: ServerProcess, enabled: bool) -> None:
    """Turn a `switch` server's metrics on or off (`metrics_switch`)."""
    with httpx.Client(base_url=server.origin, headers=server.headers, timeout=30) as c:
        r = c.post(metrics_switch.PATH, content="on" if enabled else "off")
        assert r.status_code == 204, r.text


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it (the server's inference worker and its helpers)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        found.append(current := todo.pop())
        todo.extend(children.get(current, []))
    return found


def pin(server: ServerProcess, cpu: int) -> None:
    """Confine every thread of the server, its worker and their children to `cpu` (`--pin`);
    threads started later inherit it from the thread that starts them."""
    assert server.proc is not None
    for pid in descendants(server.proc.pid):
        for task in Path(f"/proc/{pid}/task").glob("*"):
            with contextlib.suppress(ProcessLookupError, FileNotFoundError):  # it ended
                os.sched_setaffinity(int(task.name), {cpu})


def pin_pair(servers: dict[str, ServerProcess], order: tuple[str, ...], cpus: list[int]) -> None:
    """With `--pin`, the server started first gets the first CPU: the servers swap CPUs
    between the legs of a round as they swap start order."""
    for m, cpu in zip(order, cpus, strict=False):
        pin(servers[m], cpu)


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


def server_cpu(server: ServerProcess) -> float:
    """CPU seconds (user + system) the Jupyter server process has used so far: where the
    metrics are kept (the inference worker, its child, is not counted)."""
    assert server.proc is not None
    fields = Path(f"/proc/{server.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def single(server: ServerProcess, prompt: str, tokens: int) -> tuple[int, float, float]:
    """(output tokens, decode seconds from first to last delta, seconds from sent to last)."""
    n, sent, first, last = stream_one(server, prompt, tokens)
    return n, last - first, last - sent


def concurrent(server: ServerProcess, prompts: list[str], tokens: int) -> tuple[int, float]:
    """(all output tokens, seconds from release to the last stream's last delta)."""
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
    return sum(r[0] for r in results), ended - begun


def measure(
    server: ServerProcess,
    args: argparse.Namespace,
    round_: int,
    pair: int,
    barrier: threading.Barrier | None,
) -> tuple[float, ...]:
    """One block: a single stream, then `--streams` at once. (decoded tokens, decode s, tokens,
    end-to-end s, all tokens of the streams, their wall time). With a `barrier`, both phases
    start when the other server's do (`--together`).

    The same prompts for both modes in a pair (each server has its own prompt cache): a
    different text would change how many speculative drafts are accepted, which moves tok/s by
    more than the metrics cost. A pair's prompts are new to each server (no prompt-cache hit)."""
    prompt = f"Round {round_}.{pair}: tell me about the sea."
    if barrier is not None:
        barrier.wait()
    n, decode_s, e2e_s = single(server, prompt, args.tokens)
    prompts = [f"Round {round_}.{pair}, stream {i}: describe a city." for i in range(args.streams)]
    if barrier is not None:
        barrier.wait()
    total, wall = concurrent(server, prompts, args.tokens)
    return (n - 1, decode_s, n, e2e_s, total, wall)


def timed_cpu(server: ServerProcess, fn: Any) -> tuple[Any, float]:
    """`fn()` and the server CPU seconds spent meanwhile."""
    before = server_cpu(server)
    out = fn()
    return out, server_cpu(server) - before


def together(
    servers: dict[str, ServerProcess], args: argparse.Namespace, round_: int, pair: int
) -> dict[str, tuple[float, ...]]:
    """A pair's blocks on both servers at the same time, each phase started together; each
    with the server CPU seconds it took, last."""
    barrier = threading.Barrier(len(servers))
    got: dict[str, tuple[float, ...]] = {}
    cpu: dict[str, float] = {}

    def run(mode: str) -> None:
        got[mode], cpu[mode] = timed_cpu(
            servers[mode], lambda: measure(servers[mode], args, round_, pair, barrier)
        )

    threads = [threading.Thread(target=run, args=(m,)) for m in servers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {m: (*got[m], cpu[m]) for m in servers}


POOLED = ("decoded", "decode_s", "n", "e2e_s", "total", "wall")


def add(pooled: dict[str, float], got: tuple[float, ...], cpu: float) -> None:
    for key, v in zip(POOLED, got, strict=True):
        pooled[key] += v
    pooled["cpu"] += cpu


def rates(got: tuple[float, ...]) -> str:
    return f"single {per(got[0], got[1]):.2f} tok/s, streams {per(got[4], got[5]):.2f} tok/s"


def per(tokens: float, seconds: float) -> float:
    """Tokens per second; NaN when every token came in one delta (no time between)."""
    return tokens / seconds if seconds > 0 else float("nan")


def abba(per_mode: int, round_: int) -> list[str]:
    """The order of a round's blocks (or creates): (on, off, off, on) repeated, starting with
    off in odd rounds, `per_mode` of each mode."""
    first, second = MODES if round_ % 2 == 0 else MODES[::-1]
    quad = [first, second, second, first]
    return (quad * per_mode)[: 2 * per_mode]


CREATE = {"input": "hi", "background": True, "max_output_tokens": 1, "temperature": 0}


def create_once(client: Any) -> float:
    """One background create → 202, in milliseconds."""
    t = time.perf_counter()
    r = client.post("/responses", json=CREATE)
    elapsed = (time.perf_counter() - t) * 1000
    assert r.status_code == 202, r.text
    return elapsed


def creates(server: ServerProcess, n: int) -> list[float]:
    with server.client() as c:
        return [create_once(c) for _ in range(n)]


def record_round(
    samples: dict[str, dict[str, list[float]]],
    pooled: dict[str, dict[str, float]],
    times: dict[str, list[float]],
    create_cpu: dict[str, float],
    args: argparse.Namespace,
    round_: int,
) -> None:
    """A round's figures per mode, from its pooled blocks and its creates, added to `samples`."""
    for m in MODES:
        got_round = pooled[m]
        samples[m]["single"].append(per(got_round["decoded"], got_round["decode_s"]))
        samples[m]["single_e2e"].append(per(got_round["n"], got_round["e2e_s"]))
        samples[m]["aggregate"].append(per(got_round["total"], got_round["wall"]))
        # What the server process spent per output token (single + streams), in ms.
        samples[m]["cpu_per_token"].append(
            1000 * got_round["cpu"] / max(1.0, got_round["n"] + got_round["total"])
        )
        samples[m]["create_p50"].append(pct(times[m], 0.5))
        samples[m]["create_p99"].append(pct(times[m], 0.99))
        samples[m]["cpu_per_create"].append(1000 * create_cpu[m] / len(times[m]))
    log(
        f"round {round_}: single on/off "
        f"{samples['on']['single'][-1] / samples['off']['single'][-1]:.3f}, "
        f"{args.streams} streams on/off "
        f"{samples['on']['aggregate'][-1] / samples['off']['aggregate'][-1]:.3f}, "
        f"create → 202 p50 on {samples['on']['create_p50'][-1]:.2f} ms, "
        f"off {samples['off']['create_p50'][-1]:.2f} ms"
    )


def switch_round(
    base: Path, model: Path, args: argparse.Namespace, round_: int, on: Any
) -> tuple[dict[str, dict[str, float]], dict[str, list[float]], dict[str, float]]:
    """One round of `--switch`: one server for the generation and one for the creates, each
    serving both modes, its metrics turned on or off before each block (ABBA order). Returns,
    per mode, the pooled generation figures with their server CPU, the create times and the
    creates' server CPU."""
    pooled = {m: dict.fromkeys((*POOLED, "cpu"), 0.0) for m in MODES}
    times: dict[str, list[float]] = {m: [] for m in MODES}
    create_cpu = dict.fromkeys(MODES, 0.0)
    # No speculation and no prompt cache: a pair's two blocks (the same prompts) are then the
    # same work on the same process, whichever mode runs first.
    same_work = {"speculative_decoding": False, "prompt_cache_bytes": 0}
    server = start(base, f"gen-{round_}", model, True, switch=True, max_batch_size=8, **same_work)
    try:
        # A whole block first, not timed: the first 8-stream batch of a process is slower.
        measure(server, args, round_, -1, None)
        for block, m in enumerate(abba(args.pairs, round_)):
            set_metrics(server, on(m))
            got, cpu = timed_cpu(server, partial(measure, server, args, round_, block // 2, None))
            add(pooled[m], got, cpu)
            log(f"round {round_} block {block} {m}: {rates(got)}")
    finally:
        server.stop()
    slow = {"max_batch_size": 1, "engine_token_delay": 60}
    server = start(base, f"create-{round_}", model, True, switch=True, **slow)
    try:
        with server.client() as client:
            for _ in range(20):  # warm up the connection and the code paths
                create_once(client)
            per_block = args.create_block
            # main() refuses a --creates that is not a positive multiple of --create-block.
            for m in abba(args.creates // per_block, round_):
                set_metrics(server, on(m))
                got_times, cpu = timed_cpu(
                    server, lambda: [create_once(client) for _ in range(per_block)]
                )
                times[m].extend(got_times)
                create_cpu[m] += cpu
    finally:
        server.stop()
    return pooled, times, create_cpu


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64, help="output tokens per stream")
    parser.add_argument("--streams", type=int, default=8, help="concurrent streams")
    parser.add_argument("--creates", type=int, default=200, help="creates per round and mode")
    parser.add_argument(
        "--pairs", type=int, default=4, help="ABBA blocks per mode and round (see above)"
    )
    parser.add_argument(
        "--control",
        action="store_true",
        help="an A/A run: both servers with metrics off (the 'on' column is a second 'off' "
        "server), to show what two identical servers differ by here",
    )
    parser.add_argument(
        "--together",
        action="store_true",
        help="run each pair's blocks on both servers at the same time (the same prompts, "
        "each phase started together) instead of one after the other in ABBA order",
    )
    parser.add_argument(
        "--pin",
        action="store_true",
        help="confine each server with its worker to a CPU of its own (the servers swap CPUs "
        "between a round's legs): the two no longer compete for cores, and what a server's "
        "process spends is taken from its own worker",
    )
    parser.add_argument(
        "--switch",
        action="store_true",
        help="one server per round serves both modes, its metrics turned on and off between "
        "blocks (ABBA order; speculation and the prompt cache off, so a pair's blocks are the "
        "same work): no second process, and adjacent blocks meet the same moment of the machine",
    )
    parser.add_argument(
        "--create-block",
        type=int,
        default=10,
        help="with --switch: creates per block (the metrics are switched between blocks)",
    )
    parser.add_argument("--model", choices=("demo", "tiny"), default="demo")
    parser.add_argument("--out", type=Path, default=RESULTS / "metrics")
    args = parser.parse_args()
    if args.switch and (args.together or args.pin):
        parser.error("--switch runs one server per round: --together and --pin are for pairs")
    if args.switch and (
        args.create_block < 1
        or args.creates < args.create_block
        or args.creates % args.create_block
    ):
        parser.error(
            f"--switch times creates in blocks of --create-block ({args.create_block}): "
            f"--creates ({args.creates}) must be a positive multiple of it"
        )
    started = time.strftime("%Y-%m-%d %H:%M:%S")

    def on(mode: str) -> bool:
        """Whether the `mode` server records metrics (never, in an A/A `--control` run)."""
        return mode == "on" and not args.control

    load_before = os.getloadavg()

    base = Path(tempfile.mkdtemp(prefix="lmsp-bench-metrics-"))
    model = model_dir(args.model, base)
    samples: dict[str, dict[str, list[float]]] = {
        m: {
            "single": [],
            "single_e2e": [],
            "aggregate": [],
            "cpu_per_token": [],
            "create_p50": [],
            "create_p99": [],
            "cpu_per_create": [],
        }
        for m in MODES
    }
    cpus = sorted(os.sched_getaffinity(0))[:2]
    if args.pin and len(cpus) < 2:
        parser.error("--pin needs two CPUs")
    pairs_per_leg = max(1, args.pairs // 2)
    creates_per_leg = max(1, args.creates // 2)
    for round_ in range(args.rounds):
        if args.switch:
            pooled, times, create_cpu = switch_round(base, model, args, round_, on)
            record_round(samples, pooled, times, create_cpu, args, round_)
            continue
        # Per mode: single-stream (tokens, decode s, end-to-end s), aggregate (tokens, s) and
        # server CPU, pooled over the round's blocks; create times and CPU, over its creates.
        pooled = {m: dict.fromkeys((*POOLED, "cpu"), 0.0) for m in MODES}
        times: dict[str, list[float]] = {m: [] for m in MODES}
        create_cpu = dict.fromkeys(MODES, 0.0)
        for leg in range(2):
            # A fresh pair of servers per leg, started in the other order in the other leg:
            # which one starts first moves its speed by ~2% here (found in an A/A run), and
            # each process has its own memory layout; a round meets both orders.
            order = MODES if (round_ + leg) % 2 == 0 else MODES[::-1]
            log(f"round {round_} leg {leg}: generation servers, started {' then '.join(order)}")
            servers = {
                m: start(base, f"gen-{round_}-{leg}-{m}", model, on(m), max_batch_size=8)
                for m in order
            }
            try:
                for m in order:  # warm up (worker started, model loaded) in start order too
                    single(servers[m], f"Warm up {round_}.{leg}.", 8)  # the same for both
                if args.pin:
                    pin_pair(servers, order, cpus)
                for pair in range(leg * pairs_per_leg, (leg + 1) * pairs_per_leg):
                    if args.together:
                        got = together(servers, args, round_, pair)
                        for m in MODES:
                            add(pooled[m], got[m][:-1], got[m][-1])
                            log(f"round {round_} pair {pair} {m} (together): {rates(got[m])}")
                    else:
                        for m in abba(1, round_ + pair):
                            server = servers[m]
                            got_one, cpu = timed_cpu(
                                server, partial(measure, server, args, round_, pair, None)
                            )
                            add(pooled[m], got_one, cpu)
                            log(f"round {round_} pair {pair} {m}: {rates(got_one)}")
            finally:
                for s in servers.values():
                    s.stop()
            log(f"round {round_} leg {leg}: create servers (the worker holds one slow task)")
            slow = {"max_batch_size": 1, "engine_token_delay": 60}
            servers = {
                m: start(base, f"create-{round_}-{leg}-{m}", model, on(m), **slow) for m in order
            }
            clients = {m: servers[m].client() for m in MODES}
            try:
                for m in order:
                    creates(servers[m], 20)  # warm up connections and code paths
                if args.pin:
                    pin_pair(servers, order, cpus)
                # One create at a time, alternating in ABBA order request by request: the
                # machine's drift meets both modes alike.
                cpu_before = {m: server_cpu(servers[m]) for m in MODES}
                for m in abba(creates_per_leg, round_ + leg):
                    times[m].append(create_once(clients[m]))
                for m in MODES:
                    create_cpu[m] += server_cpu(servers[m]) - cpu_before[m]
            finally:
                for c in clients.values():
                    c.close()
                for s in servers.values():
                    s.stop()
        record_round(samples, pooled, times, create_cpu, args, round_)

    rows = [
        ("single-stream decode tok/s", "single", True),
        ("single-stream end-to-end tok/s", "single_e2e", True),
        (f"{args.streams}-stream aggregate tok/s", "aggregate", True),
        ("server CPU ms per output token", "cpu_per_token", False),
        ("create → 202 p50 ms", "create_p50", False),
        ("create → 202 p99 ms", "create_p99", False),
        ("server CPU ms per create", "cpu_per_create", False),
    ]
    table = []
    for label, key, higher_is_better in rows:
        median_on = statistics.median(samples["on"][key])
        median_off = statistics.median(samples["off"][key])
        # The cost of metrics, in percent: positive = slower with metrics on; per round (the
        # two modes met the same moment of the machine), its median and spread.
        per_round = [
            ((f - o) / f if higher_is_better else (o - f) / f) * 100
            for o, f in zip(samples["on"][key], samples["off"][key], strict=True)
        ]
        cost = statistics.median(per_round)
        table.append(
            {
                "what": label,
                "on": median_on,
                "off": median_off,
                "cost_percent": cost,
                "cost_min": min(per_round),
                "cost_max": max(per_round),
            }
        )
    meta = {
        "model": args.model,
        "rounds": args.rounds,
        "pairs": args.pairs,
        "together": args.together,
        "pin": args.pin,
        "control": args.control,
        "switch": args.switch,
        "create_block": args.create_block if args.switch else None,
        "tokens": args.tokens,
        "streams": args.streams,
        "creates": args.creates,
        "cpus": os.cpu_count(),
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "started": started,
        "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(
        json.dumps({"meta": meta, "samples": samples, "table": table}, indent=2)
    )
    lines = [
        "# Metrics on vs off",
        "",
        f"`benchmarks/bench_metrics.py --rounds {args.rounds} --pairs {args.pairs} --tokens "
        f"{args.tokens} --streams {args.streams} --creates {args.creates} --model {args.model}"
        + (" --together" if args.together else "")
        + (" --pin" if args.pin else "")
        + (" --control" if args.control else "")
        + (f" --switch --create-block {args.create_block}" if args.switch else "")
        + "`"
        f", {meta['started']} – {meta['finished']}. {meta['cpus']} CPUs, load average "
        f"{load_before[0]:.1f} before / {meta['load_after'][0]:.1f} after.",
        (
            (
                "**A/A control (`--control`): metrics off in both modes**; the 'on' column is "
                "the server's blocks of a second 'off' mode, so the cost columns show what "
                "identical blocks differ by on this machine."
                if args.switch
                else "**A/A control (`--control`): both servers have metrics off**; the 'on' "
                "column is a second 'off' server, so the cost columns show what two identical "
                "servers differ by on this machine."
            )
            if args.control
            else "Cost: how much worse with metrics on (target ≤ 2%, over the whole spread)."
        ),
        "",
        *(switch_text(args) if args.switch else pair_text(args)),
        "",
        "| what | metrics on | metrics off | cost (median of rounds) | cost per round (min – max) "
        "|",
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


def switch_text(args: argparse.Namespace) -> list[str]:
    """How a `--switch` run was measured, for its report."""
    return [
        "`--switch`: one server per round serves both modes, its metrics turned on or off "
        "(`metrics.set_enabled`, what `LMSPExtension.metrics` sets at start-up, through the "
        "benchmark's `metrics_switch` server extension) before each block; a fresh server per "
        "round for the generation and another for the creates. Speculative decoding and the "
        "prompt cache are off, so a pair's two blocks (the same prompts) are the same work on "
        "the same process; no second server competes for the CPUs.",
        f"Each round: {args.pairs} blocks per mode in ABBA order (on, off, off, on, ...; odd "
        f"rounds start with off), a block being a single stream then {args.streams} streams; "
        f"a round's figure pools its blocks. Creates: {args.creates} per mode and round, "
        f"in blocks of {args.create_block} in ABBA order, one at a time. Per-round cost = the "
        "round's on vs off. *Server CPU* rows: the Jupyter server process's own CPU time (user "
        "+ system, from /proc; the inference worker not counted) per output token or per "
        "create, by the blocks of each mode.",
    ]


def pair_text(args: argparse.Namespace) -> list[str]:
    """How a run with a server pair per leg was measured, for its report."""
    return [
        "Each round has two legs, each with a fresh pair of servers (one with metrics on, "
        "one off) for the generation and another for the creates, started on-first in one leg "
        "and off-first in the other (in A/A runs the first-started server of a pair answered "
        "creates ~2% slower: a round meets both orders, and each leg new processes)."
        + (
            " `--pin`: each server, with its worker, confined to a CPU of its own (the first-"
            "started one to the first CPU, so they swap CPUs between the legs): the servers do "
            "not compete for cores, and what a server's process spends is taken from its own "
            "worker."
            if args.pin
            else ""
        ),
        (
            f"Each round: {args.pairs} blocks per mode, each pair's two blocks run on both "
            "servers at the same time (`--together`: each phase, single stream then "
            f"{args.streams} streams, started together), so both meet the same moment of the "
            "machine"
            if args.together
            else f"Each round: {args.pairs} blocks per mode in ABBA order (on, off, off, on, "
            "...; odd rounds start with off)"
        )
        + "; the same prompts for both modes in a pair of blocks; a round's figure pools its "
        f"blocks (half in each leg). Creates: {args.creates} per mode and round (half in each "
        "leg), one at a time, alternating "
        "between the modes request by request in ABBA order. Per-round cost = the round's on "
        "vs off. *Server CPU* rows: the Jupyter server process's own CPU time (user + "
        "system, from /proc; the inference worker not counted) per output token or per create "
        "— where the metrics are kept, so on minus off is what they cost, independent of the "
        "machine's speed drift.",
    ]


if __name__ == "__main__":
    sys.exit(main())
