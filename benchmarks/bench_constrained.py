"""Constrained-decoding benchmark: 8 concurrent streams, every one constrained vs none.

One command, on the demo model (SmolLM2-135M-Instruct, converted on first use):

    .venv/bin/python benchmarks/bench_constrained.py

It drives the inference worker process the service runs (`EngineClient`, with the BLAS the
service would choose, `--blas-threads` threads) with `--streams` jobs submitted together, greedy,
`--tokens` tokens each, and measures, side by side in interleaved rounds (the order rotating):

- **none**: no constraint (story prompts that run to max_tokens);
- **json string**: `{"story": <string of at least 4000 characters>}`, a JSON schema whose mask
  is mostly the string lexeme;
- **json structured**: an array of at least 50 objects of enums, bounded integers and short
  strings, `additionalProperties: false`, whose mask changes at almost every token.

No constrained stream can end before max_tokens (their schemas cannot be complete sooner), so
every variant produces the same number of tokens. Aggregate tok/s = all tokens / (last job
ended − first job submitted), prefill included; decode tok/s = tokens after each stream's
first / (last token − the moment every stream had its first). Each stream has a prompt never
seen before (a nonce), so the prompt cache never helps, and every variant has the same
prompts (the grammar alone shapes the output). Target: constrained ≥ 0.9× none.

Writes `benchmarks/results/constrained.md` and `constrained.json`. Options: `--help`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import threading
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DEFAULT_MODEL_DIR = Path.home() / ".cache" / "jupyter-lmsp" / "models"

STORIES = [
    "Write a long story about a lighthouse keeper who finds a message in a bottle.",
    "Write a long story about a robot learning to paint.",
    "Write a detailed essay about the history of bridges.",
    "Write a long story about two friends sailing around the world.",
    "Explain in detail how a steam engine works, step by step.",
    "Write a long story about a dragon who is afraid of the dark.",
    "Write a detailed guide to growing tomatoes in a small garden.",
    "Write a long story about a city that floats in the clouds.",
]
STRING_SCHEMA = {
    "type": "object",
    "properties": {"story": {"type": "string", "minLength": 4000}},
    "required": ["story"],
    "additionalProperties": False,
}
STRUCTURED_SCHEMA = {
    "type": "array",
    "minItems": 50,
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "role": {"enum": ["keeper", "sailor", "painter", "dragon", "gardener"]},
            "age": {"type": "integer", "minimum": 1, "maximum": 120},
            "alive": {"type": "boolean"},
        },
        "required": ["name", "role", "age", "alive"],
        "additionalProperties": False,
    },
}
VARIANTS = {"none": None, "json string": STRING_SCHEMA, "json structured": STRUCTURED_SCHEMA}


class Engine:
    """The worker process, with a record of every message's arrival time."""

    def __init__(self, env: dict[str, str] | None, streams: int, speculation: bool) -> None:
        from jupyter_lmsp.engine.client import EngineClient
        from jupyter_lmsp.engine.messages import WorkerReady, WorkerSettings
        from jupyter_lmsp.engine.speculative import OFF, SpeculationSettings

        self._lock = threading.Condition()
        self.messages: list[tuple[float, Any]] = []
        settings = WorkerSettings(
            max_batch_size=streams,
            speculation=SpeculationSettings() if speculation else OFF,
        )
        self.client = EngineClient(self._on_message, env=env, settings=settings)
        self.client.start()
        self.wait(lambda m: isinstance(m, WorkerReady))

    def _on_message(self, message: Any) -> None:
        with self._lock:
            self.messages.append((time.perf_counter(), message))
            self._lock.notify_all()

    def wait(self, predicate: Any, timeout: float = 900) -> Any:
        deadline = time.monotonic() + timeout
        with self._lock:
            while True:
                for _, message in self.messages:
                    if predicate(message):
                        return message
                if time.monotonic() > deadline:
                    raise RuntimeError("timed out waiting for the worker")
                self._lock.wait(1)


def cpu_times() -> tuple[int, int]:
    """The machine's (stolen, total) CPU time so far, in clock ticks (/proc/stat; zeros where
    there is none): time the hypervisor gave other guests is what makes a VM's blocks slow."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except OSError:
        return 0, 0
    ticks = [int(f) for f in fields[:8]]
    return ticks[7], sum(ticks)


def one_round(
    engine: Engine, model: Path, variant: str, streams: int, tokens: int
) -> dict[str, Any]:
    from jupyter_lmsp.engine.grammars import ResponseFormat
    from jupyter_lmsp.engine.messages import GenerateJob, JobFailed, JobFinished, JobTokens

    schema = VARIANTS[variant]
    nonce = uuid.uuid4().hex[:8]
    jobs = []
    for i in range(streams):
        # The same prompts for every variant, so the prefill is the same work.
        ask = STORIES[i % len(STORIES)]
        jobs.append(
            GenerateJob(
                job_id=f"{nonce}-{i}",
                model_path=str(model),
                messages=[
                    {"role": "system", "content": f"Session {nonce}-{i}. You are a writer."},
                    {"role": "user", "content": ask},
                ],
                max_tokens=tokens,
                response_format=(
                    ResponseFormat("json_schema", schema, strict=True) if schema else None
                ),
            )
        )
    mark = len(engine.messages)
    stolen_before, ticks_before = cpu_times()
    sent = time.perf_counter()
    for job in jobs:
        engine.client.submit(job)
    ids = {job.job_id for job in jobs}
    for job in jobs:
        end = engine.wait(
            lambda m, j=job.job_id: isinstance(m, JobFinished | JobFailed) and m.job_id == j
        )
        if isinstance(end, JobFailed):
            raise RuntimeError(f"{variant}: {end.code}: {end.message}")
    stolen_after, ticks_after = cpu_times()
    firsts: dict[str, float] = {}
    lasts: dict[str, float] = {}
    produced: dict[str, int] = dict.fromkeys(ids, 0)
    for at, message in engine.messages[mark:]:
        if isinstance(message, JobTokens) and message.job_id in ids and message.token_ids:
            firsts.setdefault(message.job_id, at)
            lasts[message.job_id] = at
            produced[message.job_id] += len(message.token_ids)
    ended = max(at for at, m in engine.messages[mark:] if isinstance(m, JobFinished))
    total = sum(produced.values())
    all_started = max(firsts.values())
    after_first = sum(
        sum(
            len(m.token_ids)
            for at, m in engine.messages[mark:]
            if isinstance(m, JobTokens) and m.job_id == j and at > all_started
        )
        for j in ids
    )
    return {
        "variant": variant,
        "tokens": total,
        "min_tokens": min(produced.values()),
        "seconds": ended - sent,
        "aggregate_tps": total / (ended - sent),
        "decode_tokens": after_first,
        "decode_seconds": max(1e-9, max(lasts.values()) - all_started),
        "decode_tps": after_first / max(1e-9, max(lasts.values()) - all_started),
        "steal": (stolen_after - stolen_before) / max(1, ticks_after - ticks_before),
    }


def pooled(rows: list[dict[str, Any]]) -> dict[str, dict[Any, dict[str, float]]]:
    """Per variant and round: aggregate and decode tok/s over the round's blocks (tokens summed
    over seconds summed)."""
    out: dict[str, dict[Any, dict[str, float]]] = {}
    for row in rows:
        acc = out.setdefault(row["variant"], {}).setdefault(
            row["round"], {"tokens": 0, "seconds": 0, "dtokens": 0, "dseconds": 0}
        )
        acc["tokens"] += row["tokens"]
        acc["seconds"] += row["seconds"]
        acc["dtokens"] += row["decode_tokens"]
        acc["dseconds"] += row["decode_seconds"]
    for by_round in out.values():
        for acc in by_round.values():
            acc["aggregate_tps"] = acc["tokens"] / acc["seconds"]
            acc["decode_tps"] = acc["dtokens"] / acc["dseconds"]
    return out


def spread(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.1f}"
    return f"{statistics.median(values):.1f} ({min(values):.1f}–{max(values):.1f})"


def render(meta: dict[str, Any], rounds: list[dict[str, Any]]) -> str:
    by = pooled(rounds)
    fewest = {v: min(r["min_tokens"] for r in rounds if r["variant"] == v) for v in by}
    lines = [
        "# Constrained decoding benchmark",
        "",
        f"`benchmarks/bench_constrained.py`, {meta['started']} – {meta['finished']}. Model "
        f"`{meta['model']}`, {meta['streams']} concurrent streams, greedy, {meta['tokens']} "
        f"tokens each, {meta['rounds']} round(s) of {meta.get('blocks', 1)} block(s) per "
        "variant in palindromic order (A B C C B A, the start rotating by round; a round's "
        "figure pools its blocks), median over rounds (min–max). BLAS: "
        f"{meta['blas']}, OPENBLAS_NUM_THREADS={meta['blas_threads']}, speculative decoding "
        f"{meta.get('speculation', 'on')} (`--speculation`). Machine: "
        f"{meta['cpus']} CPUs, {meta['platform']}, load average "
        f"{meta['load_before'][0]:.1f} before / {meta['load_after'][0]:.1f} after.",
        "",
        "| streams constrained by | aggregate tok/s | / none (median of rounds) "
        "| / none per round (min–max) "
        "| decode tok/s | / none | tokens per stream (fewest) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for variant, by_round in by.items():
        agg = [r["aggregate_tps"] for r in by_round.values()]
        dec = [r["decode_tps"] for r in by_round.values()]
        # Each round's ratio: the variant against `none` of the same round.
        ratios = [
            r["aggregate_tps"] / by["none"][round_]["aggregate_tps"]
            for round_, r in by_round.items()
        ]
        dec_ratios = [
            r["decode_tps"] / by["none"][round_]["decode_tps"] for round_, r in by_round.items()
        ]
        lines.append(
            f"| {variant} | {spread(agg)} | {statistics.median(ratios):.2f}× "
            f"| {min(ratios):.2f}–{max(ratios):.2f}× "
            f"| {spread(dec)} | {statistics.median(dec_ratios):.2f}× "
            f"| {fewest[variant]} |"
        )
    steal = [r["steal"] for r in rounds if "steal" in r]
    if steal:
        lines += [
            "",
            f"CPU time stolen by the hypervisor during a block (/proc/stat): median "
            f"{100 * statistics.median(steal):.1f}%, max {100 * max(steal):.1f}%.",
        ]
    lines += [
        "",
        "Aggregate = all tokens / (last job ended − first job submitted), prefill included. "
        "Decode = tokens after every stream had its first / the time from then to the last "
        "token. Every variant has the same prompts (without the schema: the grammar alone "
        "shapes the output). Target: constrained ≥ 0.9× none.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument(
        "--blocks",
        type=int,
        default=2,
        help="runs of each variant per round, in palindromic order (A B C C B A ...)",
    )
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--blas-threads", default=os.environ.get("OPENBLAS_NUM_THREADS", "1"))
    parser.add_argument(
        "--speculation",
        choices=("on", "off"),
        default="on",
        help="the worker's speculative decoding (on: the service's default; constrained rows "
        "never speculate, unconstrained ones may)",
    )
    args = parser.parse_args()

    from jupyter_lmsp.engine.blas import choose_blas
    from jupyter_lmsp.models.demo import ensure_demo_model

    model = ensure_demo_model(args.model_dir)
    # The BLAS the service would choose for a worker with this many threads (probed once, or
    # read from the cache the service reads too).
    choice = choose_blas(threads=int(args.blas_threads))
    env = choice.worker_environment()
    env["OPENBLAS_NUM_THREADS"] = str(args.blas_threads)
    blas = f"{choice.name} ({choice.reason})"
    meta: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%d %H:%M"),
        "model": model.name,
        "streams": args.streams,
        "tokens": args.tokens,
        "rounds": args.rounds,
        "blocks": args.blocks,
        "blas": blas,
        "blas_threads": args.blas_threads,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "load_before": os.getloadavg(),
    }
    meta["speculation"] = args.speculation
    engine = Engine(env, args.streams, args.speculation == "on")
    rounds = []
    try:
        # Load the model, then warm up at full size, once per variant: the first runs at this
        # size grow the caches' buffers and fault in their memory, and the first constrained
        # run builds llguidance's view of the tokenizer (~0.5 s); none of it is measured.
        one_round(engine, model, "none", 2, 4)
        for variant in VARIANTS:
            one_round(engine, model, variant, args.streams, args.tokens)
        names = list(VARIANTS)
        for i in range(args.rounds):
            rotated = names[i % len(names) :] + names[: i % len(names)]
            # Palindromic (A B C C B A): a drift of the machine's speed within the round
            # weighs on every variant alike.
            order = [
                v for b in range(args.blocks) for v in (rotated if b % 2 == 0 else rotated[::-1])
            ]
            for block, variant in enumerate(order):
                row = one_round(engine, model, variant, args.streams, args.tokens)
                rounds.append({"round": i, "block": block, **row})
                print(json.dumps(rounds[-1]), flush=True)
    finally:
        engine.client.stop()
    meta["finished"] = time.strftime("%Y-%m-%d %H:%M")
    meta["load_after"] = os.getloadavg()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "constrained.json").write_text(
        json.dumps({"meta": meta, "rounds": rounds}, indent=1)
    )
    report = render(meta, rounds)
    (args.out / "constrained.md").write_text(report)
    print(report)


if __name__ == "__main__":
    main()
