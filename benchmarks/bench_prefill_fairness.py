"""Prefill fairness (issue 43): how long a long prompt pauses another client's stream.

One command, on the demo model (SmolLM2-135M-Instruct, converted on first use):

    .venv/bin/python benchmarks/bench_prefill_fairness.py [--rounds 3] [--compare]

The inference worker itself (`EngineClient`, the BLAS the probe chooses for one thread), no
HTTP. Each round: job A (a short prompt, greedy, many tokens) decodes alone for a while: its
token gaps give one decode step (median). Then job B arrives with a ~`--prompt-tokens` prompt
(a nonce first: the prompt cache never helps) and is prefilled in chunks beside A's decode
steps; A's gaps from B's arrival to B's first token are A's pauses.

The target: A's longest pause <= 2 decode steps + 1 designed prefill chunk. The designed
chunk is what the engine sizes every chunk to cost (`engine/prefill.py`): a 128-token chunk
at the start of a prompt, i.e. B's first chunks. It is measured as A's median pause during
B's first 5 chunks minus one decode step, so the bound is "one decode step more than the
pauses at the start of the prompt": the pauses may not grow as the prompt is read.

The machine may be shared: every gap is also measured in the worker's CPU time (all its
threads), which other processes do not stretch, and the load average is recorded. The worker
stamps each step's tokens with its CPU time as it sends them (`StepTokens.cpu_time`): read
when the message arrived instead, a reader the load delayed moved CPU time from one of A's
pauses into the next, so the longest pause grew with the load. `--compare` runs a worker with fixed
128-token chunks too (the engine before cost-sized chunks: `prefill_break_even` huge), its
rounds interleaved with the others', so both see the same load; it and `--model-only` also run
the cost model's chunks without the pacer (`prefill.ChunkPacer`: chunk sizes corrected by
what the chunks measured).

Writes `benchmarks/results/prefill_fairness.md` and `.json`. Options: `--help`.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import itertools
import json
import os
import platform
import shlex
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
FILLER = (
    "The library opens at nine in the morning and closes at six in the evening, except on "
    "Sundays when it is closed and on Thursdays when it stays open until nine. "
)
TICK = os.sysconf("SC_CLK_TCK")
EARLY = 5  # B's first chunks: the designed chunk's cost


class _Timespec(ctypes.Structure):
    _fields_ = [("seconds", ctypes.c_long), ("nanoseconds", ctypes.c_long)]


_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_CLOCKS: dict[int, int] = {}


def cpu_seconds(pid: int) -> float:
    """A process's CPU time so far (all its threads), to the nanosecond: its CPU-time clock
    (`clock_getcpuclockid`); /proc/<pid>/stat's utime + stime (10 ms ticks, coarser than
    the differences this benchmark compares) where that clock cannot be read."""
    clock = _CLOCKS.get(pid)
    if clock is None:
        found = ctypes.c_int()
        if _LIBC.clock_getcpuclockid(pid, ctypes.byref(found)) == 0:
            clock = _CLOCKS[pid] = found.value
    if clock is not None:
        now = _Timespec()
        if _LIBC.clock_gettime(clock, ctypes.byref(now)) == 0:
            return now.seconds + now.nanoseconds / 1e9
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


class Timed:
    """The worker's messages with the time (wall, and the worker's CPU) each arrived."""

    def __init__(self) -> None:
        # (wall, the worker's CPU as stamped, the worker's CPU read on arrival, message)
        self.items: list[tuple[float, float, float, object]] = []
        self.cond = threading.Condition()
        self.pid: int | None = None

    def __call__(self, message: object) -> None:
        from jupyter_lmsp.engine.messages import StepTokens, WorkerReady

        now = time.monotonic()
        if isinstance(message, WorkerReady):
            self.pid = message.pid
        read = cpu_seconds(self.pid) if self.pid else 0.0
        cpu = read
        if isinstance(message, StepTokens) and message.cpu_time is not None:
            # Stamped by the worker as it sent the step: a reader that a loaded machine
            # delays would otherwise move CPU time from one of A's pauses into the next.
            cpu = message.cpu_time
        rows = message.rows if isinstance(message, StepTokens) else [message]
        with self.cond:
            self.items.extend((now, cpu, read, row) for row in rows)
            self.cond.notify_all()

    def wait(self, predicate: Any, timeout: float = 1200.0) -> tuple[float, object]:
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                for at, _, _, message in self.items:
                    if predicate(message):
                        return at, message
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("no such message")
                self.cond.wait(left)


def pauses(gaps: list[float], step: float) -> dict[str, Any]:
    """A's pauses while B prefills against the bound 2 steps + 1 designed chunk.

    The last gap ends with B's first token: it is the first step B decodes in (beside A, a
    step over B's whole context, possibly a speculative verify step), after the step that
    moved B into the batch. It counts for `within`; `prefill_only` leaves it out.
    """
    early = statistics.median(gaps[:EARLY])
    chunk = early - step
    bound = 2 * step + chunk
    reading = gaps[:-1] or gaps
    return {
        "decode_step_s": step,
        "designed_chunk_s": chunk,
        "early_pause_s": early,
        "late_pause_s": statistics.median(reading[-EARLY:]),
        "longest_pause_s": max(gaps),
        "longest_reading_pause_s": max(reading),
        "first_token_pause_s": gaps[-1],
        "bound_s": bound,
        "pauses": len(gaps),
        "pauses_over_bound": sum(g > bound for g in gaps),
        "within": max(gaps) <= bound,
        "within_prefill_only": max(reading) <= bound,
    }


def one_round(client: Any, timed: Timed, model: Path, prompt_tokens: int) -> dict[str, Any]:
    from jupyter_lmsp.engine.messages import (
        GenerateJob,
        JobFailed,
        JobFinished,
        JobStarted,
        JobTokens,
    )

    a, b = f"a-{uuid.uuid4().hex[:8]}", f"b-{uuid.uuid4().hex[:8]}"
    story = [{"role": "user", "content": f"{uuid.uuid4().hex} Write a very long story."}]
    client.submit(GenerateJob(job_id=a, model_path=str(model), messages=story, max_tokens=4000))

    def a_tokens() -> list[tuple[float, float, float]]:
        with timed.cond:
            return [
                (t, c, r)
                for t, c, r, m in timed.items
                if isinstance(m, JobTokens) and m.job_id == a
            ]

    load_before = os.getloadavg()
    # A decodes alone for a while: its steps.
    timed.wait(lambda m: isinstance(m, JobTokens) and m.job_id == a)
    while len(a_tokens()) < 25:
        time.sleep(0.05)
    alone = a_tokens()[5:]
    step = statistics.median(y[0] - x[0] for x, y in itertools.pairwise(alone))
    step_cpu = statistics.median(y[1] - x[1] for x, y in itertools.pairwise(alone))
    step_read = statistics.median(y[2] - x[2] for x, y in itertools.pairwise(alone))
    # Then B's long prompt.
    # ~1.14 tokens a word for this filler with SmolLM2's tokenizer (/1.3 gave 5,275 tokens).
    words = max(1, int(prompt_tokens / 1.14))
    text = (FILLER * (words // len(FILLER.split()) + 1)).split()[:words]
    long = [{"role": "user", "content": uuid.uuid4().hex + " " + " ".join(text) + " Sum up."}]
    sent = time.monotonic()
    client.submit(GenerateJob(job_id=b, model_path=str(model), messages=long, max_tokens=4))
    _, started = timed.wait(lambda m: isinstance(m, JobStarted) and m.job_id == b)
    first_b, _ = timed.wait(lambda m: isinstance(m, JobTokens) and m.job_id == b)
    during = [(t, c, r) for t, c, r in a_tokens() if sent <= t <= first_b]
    client.cancel(a)
    timed.wait(lambda m: isinstance(m, JobFinished | JobFailed) and m.job_id == b)
    wall = [y[0] - x[0] for x, y in itertools.pairwise(during)]
    cpu = [y[1] - x[1] for x, y in itertools.pairwise(during)]
    read = [y[2] - x[2] for x, y in itertools.pairwise(during)]
    return {
        "prompt_tokens": started.input_tokens,  # type: ignore[attr-defined]
        "prefill_s": first_b - sent,
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "wall": pauses(wall, step),
        "cpu": pauses(cpu, step_cpu),
        "cpu_read": pauses(read, step_read),
    }


def spread(rounds: list[dict[str, Any]], clock: str, key: str) -> str:
    values = [r[clock][key] if clock else r[key] for r in rounds]
    if not values:
        return "-"
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def table(name: str, rounds: list[dict[str, Any]]) -> list[str]:
    rows = [
        ("decode step (A alone)", "decode_step_s"),
        ("designed chunk (A's pause over B's first 5 chunks - 1 step)", "designed_chunk_s"),
        ("A's pauses, B's first 5 chunks (median)", "early_pause_s"),
        ("A's pauses, B's last 5 chunks (median)", "late_pause_s"),
        ("A's longest pause while B's prompt is read", "longest_reading_pause_s"),
        ("A's pause ending with B's first token", "first_token_pause_s"),
        ("A's longest pause, all", "longest_pause_s"),
        ("bound: 2 steps + 1 designed chunk", "bound_s"),
    ]
    lines = [
        f"### {name}",
        "",
        f"{len(rounds)} rounds; median (min-max), s; wall clock, and the worker's CPU time as "
        "the worker stamped it on each step's tokens and as read when they arrived.",
        "",
        "| measure | wall | worker CPU | worker CPU, read on arrival |",
        "| --- | --- | --- | --- |",
        f"| whole prefill of B (wall) | {spread(rounds, '', 'prefill_s')} | | |",
        f"| A's pauses while B prefills (count) | {spread(rounds, 'wall', 'pauses')} | | |",
    ]
    lines += [
        f"| {label} | {spread(rounds, 'wall', k)} | {spread(rounds, 'cpu', k)} | "
        f"{spread(rounds, 'cpu_read', k)} |"
        for label, k in rows
    ]
    for clock in ("wall", "cpu", "cpu_read"):
        over = [r[clock]["pauses_over_bound"] for r in rounds]
        within = sum(r[clock]["within"] for r in rounds)
        reading = sum(r[clock]["within_prefill_only"] for r in rounds)
        lines.append(
            f"| rounds within the bound ({clock}) | {within} of {len(rounds)} (pauses over it "
            f"per round: {over}; leaving out the pause of B's first token: {reading} of "
            f"{len(rounds)}) | | |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=6000)
    parser.add_argument(
        "--compare", action="store_true", help="also fixed 128-token chunks, interleaved"
    )
    parser.add_argument(
        "--model-only",
        action="store_true",
        help="also cost-sized chunks without pacing (the cost model alone), interleaved",
    )
    parser.add_argument("--model-dir", type=Path, default=Path.home() / ".cache/jupyter-lmsp")
    args = parser.parse_args()

    from jupyter_lmsp.engine.blas import choose_blas
    from jupyter_lmsp.engine.client import EngineClient
    from jupyter_lmsp.engine.messages import WorkerReady, WorkerSettings
    from jupyter_lmsp.models.demo import ensure_demo_model

    model = ensure_demo_model(args.model_dir / "models")
    blas = choose_blas(threads=1)
    configs = {"cost-sized chunks, paced": WorkerSettings()}
    if args.compare or args.model_only:
        configs["cost-sized chunks, the model alone"] = WorkerSettings(prefill_pacing=False)
    if args.compare:
        configs["fixed 128-token chunks"] = WorkerSettings(
            prefill_break_even=10**12, prefill_pacing=False
        )
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in configs}
    for i in range(args.rounds):
        for name, settings in configs.items():
            # A fresh worker per round: no round inherits another's prompt cache or memory.
            timed = Timed()
            client = EngineClient(timed, env=blas.env, settings=settings)
            client.start()
            try:
                timed.wait(lambda m: isinstance(m, WorkerReady), 120)
                found = one_round(client, timed, model, args.prompt_tokens)
            finally:
                client.stop()
            rounds[name].append(found)
            print(f"round {i + 1}, {name}: {json.dumps(found)}", flush=True)

    out = HERE / "results"
    out.mkdir(exist_ok=True)
    command = "python " + shlex.join(["benchmarks/bench_prefill_fairness.py", *sys.argv[1:]])
    summary = {
        "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "command": command,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "blas": blas.name,
        "rounds": rounds,
    }
    (out / "prefill_fairness.json").write_text(json.dumps(summary, indent=2))
    loads = [r["load_before"][0] for rs in rounds.values() for r in rs]
    loads += [r["load_after"][0] for rs in rounds.values() for r in rs]
    lines = [
        "# Prefill fairness (issue 43)",
        "",
        f"{summary['when']}, {summary['machine']}, {summary['cpus']} CPUs, BLAS "
        f"{blas.name} (1 thread), demo model, ~{args.prompt_tokens}-token prompt (B) beside "
        f"one decoding job (A). Command: `{command}`. Load average (1 min) at the rounds' "
        f"starts and ends: {min(loads):.1f}-{max(loads):.1f}.",
        "",
    ]
    for name, done in rounds.items():
        lines += [*table(name, done), ""]
    (out / "prefill_fairness.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
