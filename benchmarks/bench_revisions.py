"""Two git revisions of this repository side by side in one run (issue 41's "no regression").

    .venv/bin/python benchmarks/bench_revisions.py [--base 13901ca] [--head HEAD] [--rounds 5]

Each revision is unpacked from git (`git archive REV | tar -x`, into /tmp/lmsp-bench-<sha>,
byte-compiled as an install would be, removed afterwards; the repository's worktree list stays
as it was) and served by a real `jupyter server` of this venv's interpreter with that tree first
on PYTHONPATH and a folder of its own as the working directory (`python -m` puts the working
directory ahead of PYTHONPATH, and the venv's editable install of /work/main is on sys.path too:
neither may win). The server is started through a bootstrap (`python -c`) that prints the
`jupyter_lmsp.__file__` it imported before it runs `jupyter_server`'s main; the benchmark reads
it from the server's log and stops if it is not the revision's tree. The inference worker is
spawned by multiprocessing from that server and inherits its sys.path.

Every round serves both revisions, one after the other, the order alternating (A B, B A, ...),
each with fresh servers and a fresh data folder (database), so both meet the same machine in
every round. Per revision and round:

ENGINE (one server, `max_batch_size=8`, `blas_threads=1`, greedy, the same prompts for both
revisions in a round, each new to its server): on the demo model (SmolLM2-135M-Instruct) and on
the random-weight tiny llama of the tests, one streamed `POST /lmsp/v1/responses` (TTFT: request
sent → first delta; decode tok/s: (tokens − 1) / (last delta − first delta); end-to-end tok/s:
tokens / (request sent → response.completed)), then `--streams` at once (aggregate tok/s: all
tokens / (release → last response.completed)), `--demo-repeats` / `--tiny-repeats` times with
new prompts, pooled; the CPU seconds of the Jupyter server process and of its inference worker
(and its children) per output token over all of it, from /proc. The tiny model's random text is
mostly incomplete UTF-8, which the service holds back until it decodes, so its streams have a
few deltas: only its end-to-end and aggregate rates are reported.

CONTROL PLANE, on the same server once the engine phases are done (tiny model, idle worker):
create+complete latency of a short response (non-streamed `POST /responses`,
`max_output_tokens` 1, one at a time) and the server's CPU time per one; requests/s of
`GET /tasks/{id}` and `GET /service` (one keep-alive client, sequential); latency of an
idempotent replay (the same `POST /responses` with the same `Idempotency-Key`, answered from
the store). Then a second server whose one generation slot is held by a slow task
(`bench_control_plane.SLOW_SLOT`) for background create → 202: p50 of sequential creates and
creates/s with 8 clients (`bench_control_plane.time_creates`). Also the server's start-up time
(process start → `/service` answers, the tiny model registered).

Reported per metric: each revision's median and min–max over rounds, and the ratio head/base of
each round with its median and min–max. "No regression": the whole spread of the ratio at or
above 0.9 for throughputs, at or below 1.1 for costs (latencies, CPU per unit, start-up).
Results: benchmarks/results/revisions.md (and .json, with every sample and the command line).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_control_plane import SLOW_SLOT, harness_gc_paused, time_creates  # noqa: E402
from bench_metrics import descendants  # noqa: E402
from serverproc import ServerProcess  # noqa: E402

from jupyter_lmsp.models.testmodel import make_test_model  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
MARK = "LMSP_BENCH_MODULE"
# The server's main, after saying which jupyter_lmsp it imports (`python -c`: sys.path[0] is
# the working directory, a folder of the benchmark's own with nothing importable in it).
BOOTSTRAP = (
    "import sys, jupyter_lmsp; "
    f"print({MARK!r}, jupyter_lmsp.__file__, flush=True); "
    "from jupyter_server.serverapp import main; sys.exit(main())"
)

# name, unit, better ("higher" | "lower"), format
METRICS: list[tuple[str, str, str, str]] = [
    ("demo_ttft_s", "s", "lower", ".3f"),
    ("demo_decode_tps", "tok/s", "higher", ".1f"),
    ("demo_agg_tps", "tok/s", "higher", ".1f"),
    ("demo_server_cpu_ms_per_tok", "ms", "lower", ".2f"),
    ("demo_worker_cpu_ms_per_tok", "ms", "lower", ".1f"),
    ("tiny_e2e_tps", "tok/s", "higher", ".0f"),
    ("tiny_agg_tps", "tok/s", "higher", ".0f"),
    ("tiny_server_cpu_ms_per_tok", "ms", "lower", ".2f"),
    ("tiny_worker_cpu_ms_per_tok", "ms", "lower", ".2f"),
    ("complete_p50_ms", "ms", "lower", ".1f"),
    ("complete_server_cpu_ms", "ms", "lower", ".1f"),
    ("get_task_rps", "/s", "higher", ".0f"),
    ("get_service_rps", "/s", "higher", ".0f"),
    ("replay_p50_ms", "ms", "lower", ".2f"),
    ("create_202_p50_ms", "ms", "lower", ".2f"),
    ("creates_per_s_8", "/s", "higher", ".0f"),
    ("startup_s", "s", "lower", ".2f"),
]
LABELS = {
    "demo_ttft_s": "demo model: TTFT, 1 stream",
    "demo_decode_tps": "demo model: decode tok/s, 1 stream",
    "demo_agg_tps": "demo model: aggregate tok/s, {streams} streams",
    "demo_server_cpu_ms_per_tok": "demo model: server process CPU per output token",
    "demo_worker_cpu_ms_per_tok": "demo model: worker CPU per output token",
    "tiny_e2e_tps": "tiny model: end-to-end tok/s, 1 stream",
    "tiny_agg_tps": "tiny model: aggregate tok/s, {streams} streams",
    "tiny_server_cpu_ms_per_tok": "tiny model: server process CPU per output token",
    "tiny_worker_cpu_ms_per_tok": "tiny model: worker CPU per output token",
    "complete_p50_ms": "create+complete, 1-token response, p50",
    "complete_server_cpu_ms": "server process CPU per create+complete",
    "get_task_rps": "GET /tasks/{{id}} requests/s (sequential)",
    "get_service_rps": "GET /service requests/s (sequential)",
    "replay_p50_ms": "idempotent replay (Idempotency-Key), p50",
    "create_202_p50_ms": "background create → 202, p50 (slot held)",
    "creates_per_s_8": "background creates/s, 8 clients (slot held)",
    "startup_s": "server start → /service answers",
}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def git(*args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True
    ).stdout.strip()


def unpack(rev: str) -> tuple[str, Path]:
    """The commit `rev` names and a fresh copy of its tree (`git archive`)."""
    sha = git("rev-parse", "--verify", f"{rev}^{{commit}}")
    tree = Path(f"/tmp/lmsp-bench-{sha[:12]}")
    if tree.exists():
        shutil.rmtree(tree)
    tree.mkdir()
    archive = subprocess.Popen(["git", "-C", str(ROOT), "archive", sha], stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", str(tree)], stdin=archive.stdout, check=True)
    assert archive.wait() == 0
    # Compiled once, as an install compiles the package (pip byte-compiles what it installs):
    # where PYTHONDONTWRITEBYTECODE is set, every server and worker started from a bare tree
    # compiles it again, and the larger tree measures slower to start for that alone.
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", str(tree / "jupyter_lmsp")],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return sha, tree


class RevisionServer(ServerProcess):
    """A test-suite server whose `jupyter_lmsp` is the revision's tree's (checked at start)."""

    def __init__(self, tree: Path, data_dir: Path, **kw: Any) -> None:
        path = os.pathsep.join([str(tree), *filter(None, [os.environ.get("PYTHONPATH")])])
        super().__init__(data_dir, env={"PYTHONPATH": path}, **kw)
        self.tree = tree
        self.module_file = ""

    def client(self, **kw: Any) -> httpx.Client:
        kw.setdefault("timeout", 600)
        return httpx.Client(base_url=self.api, headers=self.headers, **kw)

    def command(self) -> list[str]:
        args = super().command()
        # Not through jupyter_lmsp.launch: an older revision may not have it.
        assert args[1:4] == ["-m", "jupyter_lmsp.launch", "jupyter_server"], args[:4]
        return [args[0], "-c", BOOTSTRAP, *args[4:]]

    def start(self, timeout: float | None = None) -> RevisionServer:
        began = time.perf_counter()
        super().start(timeout)
        self.startup_s = time.perf_counter() - began
        for line in self.log_path.read_text(errors="replace").splitlines():
            if line.startswith(MARK):
                self.module_file = line.split(" ", 1)[1]
        expected = str(self.tree / "jupyter_lmsp" / "__init__.py")
        if self.module_file != expected:
            self.stop()
            raise RuntimeError(f"the server imported {self.module_file!r}, not {expected!r}")
        return self


def proc_cpu(pid: int) -> float:
    """CPU seconds (user + system) of one process so far; 0 if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_split(server: ServerProcess) -> tuple[float, float]:
    """(the Jupyter server process's CPU seconds, its descendants': the worker's)."""
    assert server.proc is not None
    pid = server.proc.pid
    below = [p for p in descendants(pid) if p != pid]
    return proc_cpu(pid), sum(proc_cpu(p) for p in below)


def stream_one(server: ServerProcess, model: str, prompt: str, tokens: int) -> dict[str, float]:
    """One streamed greedy response: output tokens and perf_counter times sent/first/last."""
    body = {
        "model": model,
        "input": prompt,
        "stream": True,
        "max_output_tokens": tokens,
        "temperature": 0,
    }
    first = last = done = 0.0
    out, deltas = -1, 0
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
                    deltas += 1
                elif event["type"] in ("response.completed", "response.incomplete"):
                    done = time.perf_counter()
                    out = event["response"]["usage"]["output_tokens"]
                elif event["type"] == "response.failed":
                    raise RuntimeError(f"the response failed: {event}")
    assert out > 1, out
    return {
        "tokens": out,
        "deltas": deltas,
        "sent": sent,
        "first": first,
        "last": last,
        "done": done,
    }


def engine(
    server: ServerProcess, model: str, tag: str, tokens: int, streams: int, repeats: int
) -> dict:
    """`repeats` times: one stream, then `streams` at once, on `model` (new prompts each time).
    Rates pool the repeats (all tokens / all time), TTFT is their median; CPU per output token
    over everything."""
    cpu0 = cpu_split(server)
    singles: list[dict[str, float]] = []
    walls: list[float] = []
    concurrent: list[dict[str, float]] = []
    for k in range(repeats):
        singles.append(
            stream_one(server, model, f"{tag}.{k}: write a long story about the sea.", tokens)
        )
        got: list[dict[str, float]] = []
        prompts = [
            f"{tag}.{k}, stream {i}: write a long story about a city." for i in range(streams)
        ]
        threads = [
            threading.Thread(
                target=lambda p=p, into=got: into.append(stream_one(server, model, p, tokens))
            )
            for p in prompts
        ]
        begun = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(got) == streams, "a stream failed (see above)"
        walls.append(max(g["done"] for g in got) - begun)
        concurrent += got
    cpu1 = cpu_split(server)
    total = sum(g["tokens"] for g in singles + concurrent)
    decoding = [g for g in singles if g["deltas"] > 1]
    return {
        "ttft_s": statistics.median(g["first"] - g["sent"] for g in singles),
        # (tokens - 1) / (last delta - first delta); the tiny model's random text is mostly
        # incomplete UTF-8, held back until it decodes, so its deltas are few: not reported.
        "decode_tps": sum(g["tokens"] - 1 for g in decoding)
        / sum(g["last"] - g["first"] for g in decoding)
        if decoding
        else float("nan"),
        "e2e_tps": sum(g["tokens"] for g in singles) / sum(g["done"] - g["sent"] for g in singles),
        "agg_tps": sum(g["tokens"] for g in concurrent) / sum(walls),
        "server_cpu_ms_per_tok": (cpu1[0] - cpu0[0]) * 1000 / total,
        "worker_cpu_ms_per_tok": (cpu1[1] - cpu0[1]) * 1000 / total,
        "tokens": total,
        "deltas_single": [g["deltas"] for g in singles],
    }


def control(server: ServerProcess, n_complete: int, n_get: int, n_replay: int) -> dict:
    """Create+complete latency, GET rates and idempotent replays, one request at a time."""
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 1, "temperature": 0}
    with server.client() as c:
        for _ in range(10):  # warm-up: connections and code paths
            assert c.post("/responses", json=body).status_code == 200
        latencies = []
        with harness_gc_paused():
            cpu0 = cpu_split(server)[0]
            for _ in range(n_complete):
                t = time.perf_counter()
                r = c.post("/responses", json=body)
                latencies.append((time.perf_counter() - t) * 1000)
                assert r.status_code == 200 and r.json()["usage"]["output_tokens"] == 1, r.text
            cpu1 = cpu_split(server)[0]
        task_id = r.json()["task_id"]
        assert c.get(f"/tasks/{task_id}").status_code == 200

        def rate(path: str) -> float:
            for _ in range(20):
                c.get(path)
            with harness_gc_paused():
                t = time.perf_counter()
                for _ in range(n_get):
                    assert c.get(path).status_code == 200
                return n_get / (time.perf_counter() - t)

        get_task_rps = rate(f"/tasks/{task_id}")
        get_service_rps = rate("/service")
        key = {"Idempotency-Key": f"bench-{uuid.uuid4()}"}
        first = c.post("/responses", json=body, headers=key)
        assert first.status_code == 200, first.text
        replays = []
        with harness_gc_paused():
            for _ in range(n_replay):
                t = time.perf_counter()
                r = c.post("/responses", json=body, headers=key)
                replays.append((time.perf_counter() - t) * 1000)
                assert r.status_code == 200 and r.json()["id"] == first.json()["id"], r.text
    return {
        "complete_p50_ms": statistics.median(latencies),
        "complete_server_cpu_ms": (cpu1 - cpu0) * 1000 / n_complete,
        "get_task_rps": get_task_rps,
        "get_service_rps": get_service_rps,
        "replay_p50_ms": statistics.median(replays),
    }


def one_revision(
    args: argparse.Namespace, rev: dict, round_: int, base: Path, models: dict[str, Path]
) -> dict:
    """Every measurement of one revision in one round, on fresh servers and data folders."""
    tree = Path(rev["tree"])
    data = base / f"r{round_}-{rev['name']}"
    (data / "models").mkdir(parents=True)
    for name, path in models.items():
        (data / "models" / name).symlink_to(path)
    tag = f"Round {round_}"
    out: dict[str, Any] = {}
    with RevisionServer(
        tree, data, default_model="tiny", max_batch_size=args.streams, blas_threads=1
    ) as server:
        out["startup_s"] = server.startup_s
        out["module"] = server.module_file
        for model, tokens, repeats in (
            ("demo", args.demo_tokens, args.demo_repeats),
            ("tiny", args.tiny_tokens, args.tiny_repeats),
        ):
            stream_one(server, model, f"{tag}: warm up, say hello.", 4)  # loads the model
            got = engine(server, model, tag, tokens, args.streams, repeats)
            out.update({f"{model}_{k}": v for k, v in got.items()})
        out.update(control(server, args.completes, args.gets, args.replays))
    slow = base / f"r{round_}-{rev['name']}-creates"
    (slow / "models").mkdir(parents=True)
    (slow / "models" / "tiny").symlink_to(models["tiny"])
    with RevisionServer(tree, slow, **SLOW_SLOT) as server:
        latencies, rate = time_creates(server, args.creates, args.creates_concurrent // 8)
    out["create_202_p50_ms"] = statistics.median(latencies)
    out["creates_per_s_8"] = rate
    return out


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(samples: dict[str, list[dict]], streams: int) -> list[dict]:
    rows = []
    for name, unit, better, _fmt in METRICS:
        base = [s[name] for s in samples["base"]]
        head = [s[name] for s in samples["head"]]
        ratios = [h / b for h, b in zip(head, base, strict=True)]
        worst = min(ratios) if better == "higher" else max(ratios)
        ok = worst >= 0.9 if better == "higher" else worst <= 1.1
        rows.append(
            {
                "metric": name,
                "label": LABELS[name].format(streams=streams),
                "unit": unit,
                "better": better,
                "base": spread(base),
                "head": spread(head),
                "ratio": spread(ratios),
                "ratios": ratios,
                "no_regression": ok,
            }
        )
    return rows


def render(meta: dict, rows: list[dict]) -> str:
    fmt = {name: f for name, _u, _b, f in METRICS}

    def cell(s: dict[str, float], f: str) -> str:
        return f"{s['median']:{f}} ({s['min']:{f}}–{s['max']:{f}})"

    b, h = meta["base"], meta["head"]
    lines = [
        "# Two revisions side by side",
        "",
        f"{meta['machine']}, {meta['started']} to {meta['ended']} UTC. Command: "
        f"`{meta['command']}`.",
        "",
        f"Base (A) `{b['rev']}` = {b['sha'][:10]}, head (B) `{h['rev']}` = {h['sha'][:10]}. "
        f"{meta['rounds']} interleaved rounds (A B, then B A, ...), fresh servers and database "
        f"per revision and round. Engine: `max_batch_size={meta['args']['streams']}`, "
        f"`blas_threads=1`, greedy, {meta['args']['demo_tokens']} output tokens per stream on "
        f"the demo model ({meta['args']['demo_repeats']}× one stream then "
        f"{meta['args']['streams']} at once per round), {meta['args']['tiny_tokens']} on the "
        f"tiny model ({meta['args']['tiny_repeats']}× each, pooled). Control plane: "
        f"{meta['args']['completes']} create+complete, {meta['args']['gets']} GETs per path, "
        f"{meta['args']['replays']} replays, {meta['args']['creates']} sequential + "
        f"{meta['args']['creates_concurrent']} concurrent background creates per revision and "
        f"round. Load average (1, 5, 15 min) at the start {fmt_load(meta['load_before'])}, "
        f"at the end {fmt_load(meta['load_after'])}.",
        "",
        "Each cell: median (min–max) over rounds; B/A is the ratio of each round's figures. "
        "No regression: the whole B/A spread ≥ 0.9 where higher is better, ≤ 1.1 where lower "
        "is better.",
        "",
        "| metric | better | A: base | B: head | B/A median (min–max) | no regression |",
        "| --- | --- | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        f = fmt[r["metric"]]
        lines.append(
            f"| {r['label']} ({r['unit']}) | {r['better']} | {cell(r['base'], f)} | "
            f"{cell(r['head'], f)} | {cell(r['ratio'], '.2f')} | "
            f"{'yes' if r['no_regression'] else '**no**'} |"
        )
    failing = [r["label"] for r in rows if not r["no_regression"]]
    lines += [
        "",
        "Outside the band over the whole spread: "
        + (", ".join(failing) if failing else "none")
        + ".",
        "",
        "Per-round B/A ratios (round order as run):",
        "",
        "| metric | " + " | ".join(f"r{i}" for i in range(meta["rounds"])) + " |",
        "| --- |" + " ---: |" * meta["rounds"],
    ]
    for r in rows:
        lines.append(f"| {r['metric']} | " + " | ".join(f"{x:.2f}" for x in r["ratios"]) + " |")
    lines.append("")
    return "\n".join(lines)


def fmt_load(load: list[float]) -> str:
    return ", ".join(f"{x:.2f}" for x in load)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="13901ca", help="revision A (default 13901ca)")
    parser.add_argument("--head", default="HEAD", help="revision B (default HEAD)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--streams", type=int, default=8, help="concurrent streams")
    parser.add_argument("--demo-tokens", type=int, default=64)
    parser.add_argument("--tiny-tokens", type=int, default=256)
    parser.add_argument("--demo-repeats", type=int, default=1, help="engine phases per round")
    parser.add_argument("--tiny-repeats", type=int, default=3, help="engine phases per round")
    parser.add_argument("--completes", type=int, default=100, help="create+complete per round")
    parser.add_argument("--gets", type=int, default=500, help="GETs per path per round")
    parser.add_argument("--replays", type=int, default=200, help="idempotent replays per round")
    parser.add_argument("--creates", type=int, default=300, help="sequential background creates")
    parser.add_argument(
        "--creates-concurrent", type=int, default=800, help="background creates by 8 clients"
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run, printed only")
    parser.add_argument("--out", type=Path, default=RESULTS / "revisions")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.completes, args.gets, args.replays = 1, 20, 100, 20
        args.creates, args.creates_concurrent = 50, 80
        args.demo_tokens, args.tiny_tokens, args.streams = 16, 64, 2
    command = shlex.join([".venv/bin/python", "benchmarks/bench_revisions.py", *sys.argv[1:]])
    started = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    load_before = os.getloadavg()
    from jupyter_lmsp.models.demo import _default_model_dir, ensure_demo_model

    revs = {}
    try:
        for name, rev in (("base", args.base), ("head", args.head)):
            sha, tree = unpack(rev)
            revs[name] = {"name": name, "rev": rev, "sha": sha, "tree": str(tree)}
            log(f"{name}: {rev} = {sha[:10]} in {tree}")
        with tempfile.TemporaryDirectory(prefix="lmsp-bench-rev-") as tmp:
            base = Path(tmp)
            # Children run here: `python -m`/`-c` put the working directory first on sys.path.
            os.chdir(base)
            models = {
                "tiny": make_test_model(base / "tiny-model"),
                "demo": ensure_demo_model(_default_model_dir()),
            }
            samples: dict[str, list[dict]] = {"base": [], "head": []}
            for i in range(args.rounds):
                order = ["base", "head"] if i % 2 == 0 else ["head", "base"]
                for name in order:
                    log(f"round {i + 1}/{args.rounds}: {name}")
                    got = one_revision(args, revs[name], i, base, models)
                    got["order"] = order.index(name)
                    samples[name].append(got)
                    log("  " + ", ".join(f"{k}={got[k]:.3g}" for k, *_ in METRICS))
    finally:
        os.chdir(ROOT)
        for r in revs.values():
            shutil.rmtree(r["tree"], ignore_errors=True)
    rows = summarize(samples, args.streams)
    meta = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}",
        "started": started,
        "ended": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "command": command,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "base": {k: revs["base"][k] for k in ("rev", "sha")},
        "head": {k: revs["head"][k] for k in ("rev", "sha")},
        "rounds": args.rounds,
        "load_before": list(load_before),
        "load_after": list(os.getloadavg()),
        "server_traits": {"max_batch_size": args.streams, "blas_threads": 1},
        "creates_server_traits": SLOW_SLOT,
    }
    text = render(meta, rows)
    print(text)
    if args.quick:
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(text)
    args.out.with_suffix(".json").write_text(
        json.dumps({"meta": meta, "summary": rows, "samples": samples}, indent=2)
    )
    log(f"wrote {args.out.with_suffix('.md')} and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
