"""The durable pipeline against bare mlx-lm where decoding is fast (issue 42), side by side.

    .venv/bin/python benchmarks/bench_pipeline.py [--rounds 3] [--tokens 256]
        [--streams 1,8,32] [--models tiny,demo] [--variants plain,spec,grammar,logprobs]

For each model and each number of concurrent streams, in interleaved rounds (the order of the
two sides alternates), on the same machine at the same time:

- **bare**: mlx-lm's `BatchGenerator` in a child process of this script (no server, no
  database, no pipe): the prompts the service would build (the model's chat template), all
  inserted at once, stepped until every row ends (`max_tokens` or an end-of-sequence token),
  greedy. Its aggregate tokens/s (all tokens / insert → last token), time to first token (the
  mean over rows of insert → its first token), CPU per step (`time.process_time`).
- **service**: a real `jupyter server` with this extension (`max_batch_size` = the largest
  stream count, `blas_threads=1`, the same model), that many streamed `POST /chat/completions`
  released at once (threads, one keep-alive client each), greedy, the same `max_tokens`.
  Aggregate tokens/s (all completion tokens / release → last stream done), time to first
  token (the mean over streams of request sent → first chunk with content), the Jupyter
  server's CPU per output token and the worker's CPU per decode step (both from /proc; steps
  from the server's own `lmsp_batch_size` histogram count), so *worker CPU per step − bare CPU
  per step* is the worker's own Python per step.

Variants of the service (each its own phase in every round): `plain` (speculative decoding
off), `spec` (on, the default), `grammar` (a JSON schema response format), `logprobs`
(`logprobs` with 5 `top_logprobs`). The bare side is always plain: the ratio of a variant
shows what it costs.

The tiny model is the tests' random-weight llama (hidden 64, 2 layers): it decodes fast
enough on this CPU that the service's own cost per token and per step, not the model, sets the
speed — what Apple silicon or a GPU shows with real models. Its text is random, so rows may
end early at an end-of-sequence token; rates are per token, so that does not bias them.

`--revisions A,B` serves each round with two (or more) revisions side by side, their order
alternating by round: `.` is this working tree, anything else a git revision, unpacked and
imported first on the server's PYTHONPATH (`bench_revisions.RevisionServer`, which checks the
server imported that tree). Each revision's service run is paired with its own bare run.
A revision may carry settings of its own, `+name=value` (LMSPExtension traits): one tree
under two settings is compared the same way (`--revisions .,.+gather_window=0.005`).

The server's CPU is also read thread by thread (/proc/<pid>/task): the servers start with
`benchmarks/threadnames` on their PYTHONPATH, whose `sitecustomize` gives each Python thread's
name to its OS thread (the event loop is `MainThread`); the report groups them as the event
loop, the runner's commit thread (`lmsp-runner-db`), the engine client's reader, the request
path's database threads (`lmsp-db_*`) and the rest.

Writes benchmarks/results/pipeline.md and pipeline.json (every sample, the command line, load).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_metrics import descendants  # noqa: E402
from bench_revisions import RevisionServer, git, proc_cpu, unpack  # noqa: E402
from serverproc import ServerProcess  # noqa: E402

from jupyter_lmsp.models.testmodel import make_test_model  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
SCHEMA = {
    "type": "object",
    "properties": {"story": {"type": "string"}, "moral": {"type": "string"}},
    "required": ["story", "moral"],
    "additionalProperties": False,
}


def prompt(tag: str, i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{tag}, stream {i}: write a long story about a city."}]


# --- bare mlx-lm ------------------------------------------------------------------------------

BARE = r"""
import json, sys, time
import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import BatchGenerator

model_path = sys.argv[1]
model, tokenizer = load(model_path)
eos = [[t] for t in sorted(tokenizer.eos_token_ids)]
for line in sys.stdin:
    job = json.loads(line)
    prompts = [
        tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True)
        for m in job["messages"]
    ]
    rows = len(prompts)
    gen = BatchGenerator(
        model, max_tokens=job["tokens"], stop_tokens=eos,
        completion_batch_size=max(rows, 1), prefill_batch_size=max(rows, 1),
    )
    cpu0, t0 = time.process_time(), time.perf_counter()
    uids = gen.insert(prompts, max_tokens=[job["tokens"]] * rows)
    first, tokens, steps, last = {}, 0, 0, t0
    while True:
        responses = gen.next_generated()
        if not responses:
            break
        now = time.perf_counter()
        steps += 1
        for r in responses:
            tokens += 1
            first.setdefault(r.uid, now - t0)
        last = now
    cpu = time.process_time() - cpu0
    gen.close()
    print(json.dumps({
        "tokens": tokens, "wall": last - t0, "steps": steps, "cpu": cpu,
        "ttft": sum(first.values()) / max(len(first), 1),
    }), flush=True)
"""


class Bare:
    def __init__(self, model: Path) -> None:
        env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", BARE, str(model)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )

    def run(self, messages: list[list[dict[str, str]]], tokens: int) -> dict[str, float]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"messages": messages, "tokens": tokens}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the bare mlx-lm child died")
        got = json.loads(line)
        return {
            "tps": got["tokens"] / got["wall"],
            "ttft": got["ttft"],
            "cpu_ms_per_step": got["cpu"] * 1000 / max(got["steps"], 1),
            "tokens": got["tokens"],
        }

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(30)


# --- the service ------------------------------------------------------------------------------


def steps_so_far(server: ServerProcess) -> float:
    """The server's count of worker decode steps (`lmsp_batch_size` observations)."""
    text = httpx.get(f"{server.origin}/metrics", headers=server.headers, timeout=30).text
    for line in text.splitlines():
        if line.startswith("lmsp_batch_size_count"):
            return float(line.split()[-1])
    raise RuntimeError("the server reports no lmsp_batch_size_count")


def cpu(server: ServerProcess) -> tuple[float, float]:
    assert server.proc is not None
    pid = server.proc.pid
    return proc_cpu(pid), sum(proc_cpu(p) for p in descendants(pid) if p != pid)


# The server's threads, grouped (by the names `threadnames/sitecustomize.py` gives them).
THREAD_GROUPS = (
    ("loop", ("MainThread",)),
    ("commit", ("lmsp-runner-db",)),
    ("reader", ("lmsp-engine-rea",)),
    ("db", ("lmsp-db",)),
)


def thread_group(name: str) -> str:
    for group, prefixes in THREAD_GROUPS:
        if name.startswith(prefixes):
            return group
    return "rest"


def thread_cpu(server: ServerProcess) -> dict[int, tuple[str, float]]:
    """Each thread of the server process: (its name, its CPU seconds so far)."""
    assert server.proc is not None
    found: dict[int, tuple[str, float]] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for task in Path(f"/proc/{server.proc.pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended meanwhile
        found[int(task.name)] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return found


def thread_split(
    before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]
) -> dict[str, float]:
    """CPU seconds spent between the two readings, by thread group (threads that ended
    meanwhile are lost: the server's own threads live as long as it)."""
    spent: dict[str, float] = {group: 0.0 for group, _ in THREAD_GROUPS}
    spent["rest"] = 0.0
    for tid, (name, seconds) in after.items():
        spent[thread_group(name)] += seconds - before.get(tid, (name, 0.0))[1]
    return spent


def stream_chat(
    client: httpx.Client, body: dict[str, Any], start: threading.Event
) -> dict[str, float]:
    start.wait()
    sent = time.perf_counter()
    first = 0.0
    tokens = -1
    with client.stream("POST", "/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.read()!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices") or []:
                if not first and (choice.get("delta") or {}).get("content"):
                    first = time.perf_counter()
    done = time.perf_counter()
    assert tokens >= 0, "no usage chunk"
    return {"sent": sent, "first": first or done, "done": done, "tokens": tokens}


def service_run(
    server: ServerProcess,
    clients: list[httpx.Client],
    model: str,
    messages: list[list[dict[str, str]]],
    tokens: int,
    variant: str,
) -> dict[str, float]:
    bodies = []
    for m in messages:
        body: dict[str, Any] = {
            "model": model,
            "messages": m,
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": tokens,
            "temperature": 0,
        }
        if variant == "grammar":
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "story", "schema": SCHEMA, "strict": True},
            }
        elif variant == "logprobs":
            body["logprobs"] = True
            body["top_logprobs"] = 5
        bodies.append(body)
    start = threading.Event()
    got: list[dict[str, float]] = []
    errors: list[BaseException] = []

    def one(c: httpx.Client, b: dict[str, Any]) -> None:
        try:
            got.append(stream_chat(c, b, start))
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [
        threading.Thread(target=one, args=(c, b)) for c, b in zip(clients, bodies, strict=True)
    ]
    for t in threads:
        t.start()
    steps0, cpu0, threads0 = steps_so_far(server), cpu(server), thread_cpu(server)
    released = time.perf_counter()
    start.set()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    wall = max(g["done"] for g in got) - released
    cpu1, threads1, steps1 = cpu(server), thread_cpu(server), steps_so_far(server)
    total = sum(g["tokens"] for g in got)
    by_thread = thread_split(threads0, threads1)
    return {
        **{
            f"thread_{group}_ms_per_tok": seconds * 1000 / max(total, 1)
            for group, seconds in by_thread.items()
        },
        "tps": total / wall,
        "ttft": statistics.mean(g["first"] - g["sent"] for g in got),
        "server_cpu_ms_per_tok": (cpu1[0] - cpu0[0]) * 1000 / max(total, 1),
        "worker_cpu_ms_per_step": (cpu1[1] - cpu0[1]) * 1000 / max(steps1 - steps0, 1),
        "tokens": total,
    }


# --- rounds -----------------------------------------------------------------------------------


def pooled(runs: list[dict[str, float]]) -> dict[str, float]:
    """Runs of one side pooled (`--repeat`): all tokens / all wall time, figures per token
    weighted by tokens, per step and TTFT averaged."""
    if len(runs) == 1:
        return runs[0]
    tokens = sum(r["tokens"] for r in runs)
    out = {"tokens": tokens, "tps": tokens / sum(r["tokens"] / r["tps"] for r in runs)}
    for key in runs[0]:
        if key in out:
            continue
        if key.endswith("_per_tok"):
            out[key] = sum(r[key] * r["tokens"] for r in runs) / max(tokens, 1)
        else:
            out[key] = statistics.mean(r[key] for r in runs)
    return out


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def run_round(
    args: argparse.Namespace,
    bare: Bare,
    name: str,
    r: int,
    spec: bool,
    variants: list[str],
    streams: list[int],
    servers: dict[str, ServerProcess],
    samples: dict[str, Any],
) -> None:
    """One round of one model: every variant and stream count, each revision's service beside
    its own bare run (the sides' order alternating)."""
    clients = {
        label: [
            httpx.Client(base_url=server.api, headers=server.headers, timeout=600)
            for _ in range(max(streams))
        ]
        for label, server in servers.items()
    }
    for label, server in servers.items():
        service_run(server, clients[label][:1], name, [prompt("warm", 0)], 4, "plain")
    bare.run([prompt("warm", 0)], 4)
    for variant in [v for v in variants if (v == "spec") == spec]:
        for n in streams:
            for label, server in servers.items():
                messages = [prompt(f"{name} r{r} {variant} {n} {label}", i) for i in range(n)]
                sides = ["bare", "service"] if (r + n) % 2 == 0 else ["service", "bare"]
                got: dict[str, Any] = {}
                runs: dict[str, list[dict[str, float]]] = {"bare": [], "service": []}
                for k in range(args.repeat):
                    for side in sides if k % 2 == 0 else sides[::-1]:
                        if side == "bare":
                            runs["bare"].append(bare.run(messages, args.tokens))
                        else:
                            runs["service"].append(
                                service_run(
                                    server, clients[label][:n], name, messages, args.tokens, variant
                                )
                            )
                got["bare"], got["service"] = pooled(runs["bare"]), pooled(runs["service"])
                got["ratio"] = got["service"]["tps"] / got["bare"]["tps"]
                got["worker_overhead_ms_per_step"] = (
                    got["service"]["worker_cpu_ms_per_step"] - got["bare"]["cpu_ms_per_step"]
                )
                samples.setdefault(label, {}).setdefault(name, {}).setdefault(
                    variant, {}
                ).setdefault(n, []).append(got)
                threads = ", ".join(
                    f"{k[7:-11]} {v:.3f}"
                    for k, v in got["service"].items()
                    if k.startswith("thread_")
                )
                print(
                    f"{label}: {name} round {r} {variant} {n} streams: service/bare "
                    f"{got['ratio']:.2f} ({got['service']['tps']:.0f} vs "
                    f"{got['bare']['tps']:.0f} tok/s), server "
                    f"{got['service']['server_cpu_ms_per_tok']:.3f} ms/tok ({threads})",
                    flush=True,
                )
    for group in clients.values():
        for c in group:
            c.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--streams", default="1,8,32")
    parser.add_argument("--models", default="tiny,demo")
    parser.add_argument("--variants", default="plain,spec,grammar,logprobs")
    parser.add_argument("--out", type=Path, default=RESULTS / "pipeline")
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="runs of each side per round and stream count, pooled (the order alternating)",
    )
    parser.add_argument(
        "--revisions",
        default=".",
        help="comma-separated revisions served side by side in each round (`.`: this tree); "
        "`+name=value` after one adds an LMSPExtension trait to its servers "
        "(`.,.+gather_window=0.005`)",
    )
    args = parser.parse_args()
    # A SIGTERM stops the servers too (their `stop` runs on the way out), not only this script.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    streams = [int(s) for s in args.streams.split(",")]
    variants = args.variants.split(",")
    # Every server (and the bare child) names its threads: see `thread_cpu`.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "benchmarks" / "threadnames"), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    # label -> (unpacked tree or None for this one, extra service traits)
    revisions: dict[str, tuple[Path | None, dict[str, str]]] = {}
    for entry in args.revisions.split(","):
        rev, *settings = entry.split("+")
        if any("=" not in s for s in settings):
            parser.error(f"--revisions: {entry!r}: a setting is `+name=value`")
        extra = dict(s.split("=", 1) for s in settings)
        note = "".join(f" +{k}={v}" for k, v in extra.items())
        if rev == ".":
            label = f". ({git('rev-parse', '--short', 'HEAD')} + working tree){note}"
            revisions[label] = (None, extra)
        else:
            sha, tree = unpack(rev)
            revisions[f"{rev} ({sha[:7]}){note}"] = (tree, extra)
    base = Path(tempfile.mkdtemp(prefix="lmsp-pipeline-"))
    # The servers' `python -c` puts the working directory first on sys.path, ahead of a
    # revision's tree: run them from a folder with no `jupyter_lmsp` in it.
    args.out = args.out.resolve()
    os.chdir(base)
    paths: dict[str, Path] = {}
    for name in args.models.split(","):
        if name == "tiny":
            paths["tiny"] = base / "tiny"
            make_test_model(paths["tiny"])
        elif name == "demo":
            from jupyter_lmsp.models.demo import _default_model_dir, ensure_demo_model

            paths["demo"] = ensure_demo_model(_default_model_dir())
        else:
            parser.error(f"unknown model {name!r} (tiny, demo)")
    began = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load0 = list(os.getloadavg())
    # samples[model][variant][streams] = list of per-round dicts with the bare side alongside
    # (one revision: its samples; several: samples[revision][model]...)
    samples: dict[str, dict[str, dict[str, dict[int, list[dict[str, Any]]]]]] = {}
    for name, path in paths.items():
        bare = Bare(path)
        for r in range(args.rounds):
            labels = list(revisions)
            if r % 2:
                labels.reverse()
            for spec in sorted({v == "spec" for v in variants}):
                servers: dict[str, ServerProcess] = {}
                try:
                    for k, label in enumerate(labels):
                        data = base / f"data-{name}-r{r}-{k}{'s' if spec else ''}"
                        (data / "models").mkdir(parents=True)
                        (data / "models" / name).symlink_to(path)
                        traits: dict[str, Any] = {
                            "default_model": name,
                            "max_batch_size": max(streams),
                            "blas_threads": 1,
                            "speculative_decoding": spec,
                            "name": f"r{r}{'s' if spec else ''}",
                        }
                        tree, extra = revisions[label]
                        traits.update(extra)
                        servers[label] = (
                            RevisionServer(tree, data, **traits)
                            if tree is not None
                            else ServerProcess(data, **traits)
                        ).start()
                    run_round(args, bare, name, r, spec, variants, streams, servers, samples)
                finally:
                    for server in servers.values():
                        server.stop()
        bare.close()
    meta = {
        "command": " ".join([".venv/bin/python", "benchmarks/bench_pipeline.py", *sys.argv[1:]]),
        "began": began,
        "ended": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_start": load0,
        "load_end": list(os.getloadavg()),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    args.out.with_suffix(".json").write_text(
        json.dumps({"meta": meta, "samples": samples}, indent=1, default=str)
    )
    args.out.with_suffix(".md").write_text(render(meta, samples))
    print(args.out.with_suffix(".md").read_text())
    return 0


def render(meta: dict[str, Any], samples: dict[str, Any]) -> str:
    def cell(values: list[float], f: str) -> str:
        s = spread(values)
        return f"{s['median']:{f}} ({s['min']:{f}}–{s['max']:{f}})"

    groups = [g for g, _ in THREAD_GROUPS] + ["rest"]
    lines = [
        "# The pipeline against bare mlx-lm (issue 42)",
        "",
        f"{meta['machine']}, {meta['began']} to {meta['ended']}. Command: `{meta['command']}`. "
        f"Load average (1, 5, 15 min) at the start "
        f"{', '.join(f'{x:.2f}' for x in meta['load_start'])}, at the end "
        f"{', '.join(f'{x:.2f}' for x in meta['load_end'])}.",
        "",
        "Each cell: median (min–max) over interleaved rounds. Ratio = the service's aggregate "
        "tok/s / bare `BatchGenerator`'s in the same round (target ≥ 0.9 over the whole "
        "spread). Service flags: `--LMSPExtension.blas_threads=1`, "
        "`--LMSPExtension.max_batch_size=<largest stream count>`, "
        "`--LMSPExtension.speculative_decoding=False` except in the `spec` variant. "
        "Revisions (`--revisions`) are served side by side in every round, their order "
        "alternating.",
        "",
        "| revision | model | variant | streams | bare tok/s | service tok/s | ratio | "
        "TTFT bare (s) | TTFT service (s) | server CPU ms/token | worker CPU ms/step | "
        "bare CPU ms/step | worker overhead ms/step |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    threads = [
        "",
        "The server's CPU per output token (ms) by thread: the event loop (`MainThread`), the "
        "runner's commit thread (`lmsp-runner-db`), the engine client's reader, the request "
        "path's database threads (`lmsp-db_*`), the rest.",
        "",
        "| revision | model | variant | streams | " + " | ".join(groups) + " |",
        "| --- | --- | --- | ---: | " + " | ".join("---:" for _ in groups) + " |",
    ]
    for revision, by_model in samples.items():
        for model, by_variant in by_model.items():
            for variant, by_n in by_variant.items():
                for n, rows in by_n.items():
                    b = [x["bare"] for x in rows]
                    s = [x["service"] for x in rows]
                    lines.append(
                        f"| {revision} | {model} | {variant} | {n} | "
                        f"{cell([x['tps'] for x in b], '.0f')} | "
                        f"{cell([x['tps'] for x in s], '.0f')} | "
                        f"{cell([x['ratio'] for x in rows], '.2f')} | "
                        f"{cell([x['ttft'] for x in b], '.3f')} | "
                        f"{cell([x['ttft'] for x in s], '.3f')} | "
                        f"{cell([x['server_cpu_ms_per_tok'] for x in s], '.3f')} | "
                        f"{cell([x['worker_cpu_ms_per_step'] for x in s], '.2f')} | "
                        f"{cell([x['cpu_ms_per_step'] for x in b], '.2f')} | "
                        f"{cell([x['worker_overhead_ms_per_step'] for x in rows], '.2f')} |"
                    )
                    threads.append(
                        f"| {revision} | {model} | {variant} | {n} | "
                        + " | ".join(
                            cell([x.get(f"thread_{g}_ms_per_tok", 0.0) for x in s], ".3f")
                            for g in groups
                        )
                        + " |"
                    )
    lines.extend(threads)
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
