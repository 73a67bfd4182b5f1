"""Speculative decoding benchmark: the service speculating vs `mlx_lm.server`, side by side.

One command, on the demo model (SmolLM2-135M-Instruct, converted on first use):

    .venv/bin/python benchmarks/bench_speculative.py

It starts three servers, all on the BLAS the service's probe chooses (`choose_blas`, as
`bench_engine.py` does; `--blas-coretype`, `--blas-candidates`), `--blas-threads` threads each:

- **mlx_lm.server**: mlx-lm's own server. Its only speculative decoding needs a draft model
  (`--draft-model`, a second, smaller model of the same tokenizer: none exists here below the
  135M demo model) and then decodes one request at a time; it has no draft-free mode, so it
  runs with its defaults.
- **service (speculation)**: a `jupyter server` with this extension, as configured by default
  (`LMSPExtension.speculative_decoding` on).
- **service (no speculation)**: the same with `--LMSPExtension.speculative_decoding=False`.

and measures, greedy, `--tokens` tokens at most per stream, in `--rounds` interleaved rounds
(the order of the servers rotating each round, so a change of the machine's load hits all):

- (a) **grounded**, two kinds, as the issue names them ("summarise or edit a given text"):
  - **summarise**, one stream: summarise a given ~480-token text (`tests/texts.py`), and with
    `--streams` (8) concurrent streams, eight different instructions about the text (summaries,
    retellings, a proofread, a list of facts);
  - **edit**, one stream: proofread the text and return it in full, and with `--streams`
    concurrent streams, eight different edits that each return the whole text (spelling,
    tense, headings, a renamed place...). The model copies the text where it agrees with it
    and rewrites where it does not: what speculation is for;
- (b) **open-ended**, one stream: a story.

Every request ends with a nonce after the text, so the text itself may come from each server's
prompt cache (both have one) but no request is a repeat. Single stream: decode tok/s = (tokens
- 1) / (last token - first token), end-to-end tok/s = tokens / request time; concurrent:
aggregate tok/s = all tokens / (last stream done - first request sent). Every ratio is reported
as the median over the rounds with its spread (min-max of the per-round ratios). The service's
texts with and without speculation are compared (they must be equal: speculation changes no
token).

`--cost-table` instead measures what the speculative decoder's cost prior estimates
(`speculative.StepCosts.prior`, from `DEFAULT_VERIFY_COST`): one forward pass of the demo model
feeding one row n = 1..16 (and more) tokens, relative to one token, on the worker's BLAS.

Writes `benchmarks/results/speculative.md` and `speculative.json` (or `step_costs.md`/`.json`).
Every flag of the run is recorded in both. Options: `--help`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from bench_engine import (
    MlxServerTarget,
    Sample,
    ServiceTarget,
    aggregate_tps,
    cli_flags,
    log,
    machine_meta,
    model_and_blas,
    release_together,
    service_blas_traits,
)

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "tests"))
from texts import PASSAGE, STORY  # noqa: E402

DEFAULT_MODEL_DIR = Path.home() / ".cache" / "jupyter-lmsp" / "models"

# Eight tasks about the same text, for the concurrent streams; the first is the single stream's.
GROUNDED = [
    "Summarise the text above in a few paragraphs.",
    "Rewrite the text above in plain English, keeping every fact.",
    "Proofread the text above and return it in full with any mistakes corrected.",
    "List the main facts of the text above, one per line.",
    "Retell the text above for a newspaper.",
    "Write a short summary of the text above for a guidebook.",
    "Explain the text above to a child.",
    "Summarise the text above in three sentences.",
]
# Eight edits of the same text, each answered with the whole text changed a little.
EDITS = [
    "Proofread the text above and return it in full with any mistakes corrected.",
    "Return the text above in full, with British spelling throughout.",
    "Copy the text above exactly, but call the lighthouse 'the Carrow light'.",
    "Rewrite the text above in full in the present tense.",
    "Return the text above in full with a short heading before each paragraph.",
    "Correct the punctuation of the text above and return the whole text.",
    "Return the text above in full, writing every year out in words.",
    "Repeat the text above in full, then add one sentence about the lighthouse today.",
]
OPEN = [
    STORY,
    "Write a long story about a robot learning to paint.",
    "Write a long story about a dragon who is afraid of the dark.",
]


def grounded(task: int, nonce: str) -> list[dict[str, str]]:
    return [
        {
            "role": "user",
            "content": f"{PASSAGE}\n\n{GROUNDED[task % len(GROUNDED)]} (Request {nonce}.)",
        }
    ]


def edit(task: int, nonce: str) -> list[dict[str, str]]:
    return [
        {
            "role": "user",
            "content": f"{PASSAGE}\n\n{EDITS[task % len(EDITS)]} (Request {nonce}.)",
        }
    ]


def open_ended(task: int, nonce: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{OPEN[task % len(OPEN)]} (Request {nonce}.)"}]


# --- targets: the bench_engine ones, keeping the text ----------------------------------------


class Mlx(MlxServerTarget):
    def streamed(self, messages: list[dict[str, str]], max_tokens: int) -> tuple[Sample, str]:
        return self.stream_with_text(messages, max_tokens)


class Service(ServiceTarget):
    def __init__(
        self,
        name: str,
        model: Path,
        data_dir: Path,
        max_batch_size: int,
        traits: dict[str, Any],
    ) -> None:
        self.name = name
        super().__init__(model, data_dir, max_batch_size, traits)

    def streamed(self, messages: list[dict[str, str]], max_tokens: int) -> tuple[Sample, str]:
        sample, _id, text = self.stream_with_id(messages, max_tokens)
        return sample, text


def concurrently(target: Any, prompts: list[list[dict[str, str]]], max_tokens: int) -> list:
    """Every prompt as its own stream, released together."""
    return release_together([lambda p=p: target.streamed(p, max_tokens) for p in prompts])


# --- the run ----------------------------------------------------------------------------------

MLX = "mlx_lm.server"
ON = "service (speculation)"
OFF = "service (no speculation)"
# Single-stream workloads, then concurrent ones (`--streams` streams), with their prompts.
SINGLE = {"grounded": grounded, "edit": edit, "open-ended": open_ended}
CONCURRENT = {"grounded x streams": grounded, "edit x streams": edit}
WORKLOADS = (*SINGLE, *CONCURRENT)


def run(args: argparse.Namespace) -> dict[str, Any]:
    model, blas = model_and_blas(args)  # puts this checkout first on sys.path
    from jupyter_lmsp.engine.blas.candidates import read_cpu

    log(f"model {model}; BLAS {blas.name} ({blas.reason})")
    blas_traits = service_blas_traits(args, blas)
    cpu = read_cpu()
    meta = {
        "model": model.name,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "openblas_coretype": blas.coretype or os.environ.get("OPENBLAS_CORETYPE") or "",
        "environment": {k: v for k, v in os.environ.items() if k.startswith("OPENBLAS_")},
        "cpu": {"model": cpu.model, "avx512": cpu.avx512},
        **machine_meta(blas),
    }
    samples: dict[str, dict[str, list[Any]]] = {w: {} for w in WORKLOADS}
    tmp = Path(tempfile.mkdtemp(prefix="lmsp-bench-spec-"))
    targets: list[Any] = []
    try:
        targets.append(Mlx(model, blas.worker_environment(), tmp))
        max_draft = {"speculative_max_draft": args.max_draft} if args.max_draft else {}
        if args.no_learn_costs:
            max_draft["speculative_learn_costs"] = False
        if args.max_rows:
            max_draft["speculative_max_rows"] = args.max_rows
        targets.append(Service(ON, model, tmp / "on", args.streams, {**blas_traits, **max_draft}))
        targets.append(
            Service(
                OFF,
                model,
                tmp / "off",
                args.streams,
                {**blas_traits, "speculative_decoding": False},
            )
        )
        log("warming up")
        for target in targets:
            target.streamed(open_ended(0, "warm-up"), 8)
            target.streamed(grounded(0, "warm-up"), 8)
        for workload in WORKLOADS:
            for target in targets:
                samples[workload][target.name] = []
        for round_ in range(args.rounds):
            order = targets[round_ % len(targets) :] + targets[: round_ % len(targets)]
            nonce = uuid.uuid4().hex[:6]
            for target in order:
                for workload, make in SINGLE.items():
                    # The same task every round (a new nonce): the spread is the machine's.
                    sample, text = target.streamed(make(0, nonce), args.tokens)
                    samples[workload][target.name].append({**vars(sample), "text": text})
                    log(
                        f"r{round_} {workload} {target.name}: {sample.tokens} tok, decode "
                        f"{sample.decode_tps:.1f} tok/s, e2e {sample.e2e_tps:.1f} tok/s"
                    )
            for workload, make in CONCURRENT.items():
                for target in order:
                    prompts = [make(i, f"{nonce}-{i}") for i in range(args.streams)]
                    got = concurrently(target, prompts, args.tokens)
                    batch = [{**vars(s), "text": t} for s, t in got]
                    samples[workload][target.name].append(batch)
                    log(
                        f"r{round_} {workload} x{args.streams} {target.name}: "
                        f"{aggregate_tps([s for s, _ in got]):.1f} tok/s"
                    )
    finally:
        for target in reversed(targets):
            target.close()
        shutil.rmtree(tmp, ignore_errors=True)
    meta["load_after"] = os.getloadavg()
    meta["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    return {"meta": meta, "samples": samples}


# --- report -----------------------------------------------------------------------------------


def _sample(d: dict[str, Any]) -> Sample:
    return Sample(d["sent"], d["first"], d["last"], d["done"], d["tokens"])


def rates(results: dict[str, Any]) -> dict[str, dict[str, list[float]]]:
    """Per workload and server, one tok/s per round (single: decode; concurrent: aggregate)."""
    out: dict[str, dict[str, list[float]]] = {}
    for workload, by_target in results["samples"].items():
        out[workload] = {}
        for name, rounds in by_target.items():
            if workload in CONCURRENT:
                out[workload][name] = [aggregate_tps([_sample(s) for s in r]) for r in rounds]
            else:
                out[workload][name] = [_sample(s).decode_tps for s in rounds]
    return out


def e2e_rates(results: dict[str, Any]) -> dict[str, dict[str, list[float]]]:
    return {
        workload: {name: [_sample(s).e2e_tps for s in rounds] for name, rounds in by.items()}
        for workload, by in results["samples"].items()
        if workload in SINGLE
    }


def ratio(a: list[float], b: list[float]) -> dict[str, float]:
    per_round = [x / y for x, y in zip(a, b, strict=True)]
    return {
        "median": statistics.median(per_round),
        "min": min(per_round),
        "max": max(per_round),
    }


def same_texts(results: dict[str, Any], workload: str) -> str:
    on, off = results["samples"][workload][ON], results["samples"][workload][OFF]
    if workload in CONCURRENT:
        pairs = [
            (a["text"], b["text"])
            for ra, rb in zip(on, off, strict=True)
            for a, b in zip(ra, rb, strict=True)
        ]
    else:
        pairs = [(a["text"], b["text"]) for a, b in zip(on, off, strict=True)]
    equal = sum(a == b for a, b in pairs)
    return f"{equal}/{len(pairs)}"


# (median, whole spread above); (a) is either grounded kind. The spread of every ratio is shown,
# and a target is called met only when its minimum over the rounds meets it too.
TARGETS = {
    "grounded": (1.8, 1.5),
    "edit": (1.8, 1.5),
    "open-ended": (0.97, 0.97),
    "grounded x streams": (1.2, 1.2),
    "edit x streams": (1.2, 1.2),
}


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    r = rates(results)
    e2e = e2e_rates(results)
    summary: dict[str, Any] = {}
    for workload, by in r.items():
        summary[workload] = {
            "tps": {name: statistics.median(v) for name, v in by.items()},
            "on/mlx": ratio(by[ON], by[MLX]),
            "on/off": ratio(by[ON], by[OFF]),
            "off/mlx": ratio(by[OFF], by[MLX]),
            "same_text_on_off": same_texts(results, workload),
        }
        if workload in e2e:
            summary[workload]["e2e_tps"] = {
                n: statistics.median(v) for n, v in e2e[workload].items()
            }
            summary[workload]["e2e on/mlx"] = ratio(e2e[workload][ON], e2e[workload][MLX])
    return summary


def _flags(args: dict[str, Any]) -> str:
    return " ".join(cli_flags(args)) or "(defaults)"


def _r(x: dict[str, float]) -> str:
    return f"{x['median']:.2f}× ({x['min']:.2f}–{x['max']:.2f})"


def render(results: dict[str, Any], summary: dict[str, Any]) -> str:
    meta = results["meta"]
    args = meta["args"]
    lines = [
        "# Speculative decoding benchmark",
        "",
        f"`benchmarks/bench_speculative.py {_flags(args)}`, {meta['started']} – "
        f"{meta['finished']}. Model `{meta['model']}` (float32), greedy, at most {args['tokens']} "
        f"output tokens per stream, {args['rounds']} interleaved rounds. Machine: {meta['cpus']} "
        f"CPUs ({meta['cpu']['model']}), {meta['platform']}, load average "
        f"{meta['load_before'][0]:.1f} before / {meta['load_after'][0]:.1f} after. Environment: "
        + (", ".join(f"{k}={v}" for k, v in meta["environment"].items()) or "no OPENBLAS_*")
        + f". BLAS: {meta['blas_choice'].get('name')} ({meta['blas_choice'].get('config')}). "
        "Versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()) + ".",
        "",
        "mlx_lm.server has no draft-free speculative decoding (its `--draft-model` needs a "
        "second, smaller model; none exists here below the demo model) and runs with its "
        "defaults. Ratios: median over the rounds of the per-round ratio (min–max).",
        "",
        "| workload | mlx_lm.server | service, no speculation | service, speculation "
        "| speculation / mlx_lm.server | target | speculation / none | same text |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for workload in WORKLOADS:
        s = summary[workload]
        median_target, spread_target = TARGETS[workload]
        target = f"≥ {median_target}×, spread ≥ {spread_target}×"
        ok = s["on/mlx"]["median"] >= median_target and s["on/mlx"]["min"] >= spread_target
        unit = "aggregate tok/s" if workload in CONCURRENT else "decode tok/s"
        name = f"{workload} ({args['streams']} streams)" if "streams" in workload else workload
        lines.append(
            f"| {name}, {unit} | {s['tps'][MLX]:.1f} | {s['tps'][OFF]:.1f} | {s['tps'][ON]:.1f} "
            f"| {_r(s['on/mlx'])} | {target} {'✓' if ok else '✗'} | {_r(s['on/off'])} "
            f"| {s['same_text_on_off']} |"
        )
    lines += ["", "End to end (tokens / request time, prefill included), single stream:", ""]
    lines += ["| workload | mlx_lm.server | no speculation | speculation | speculation / mlx |"]
    lines += ["|---|---:|---:|---:|---:|"]
    for workload in SINGLE:
        s = summary[workload]
        lines.append(
            f"| {workload} | {s['e2e_tps'][MLX]:.1f} | {s['e2e_tps'][OFF]:.1f} "
            f"| {s['e2e_tps'][ON]:.1f} | {_r(s['e2e on/mlx'])} |"
        )
    lines += [
        "",
        "Grounded: summarise (single stream) or do one of eight tasks about (concurrent) a "
        "~480-token text; edit: proofread it and return it in full (single stream) or one of "
        "eight edits that return it in full (concurrent); open-ended: a story. Decode tok/s = (tokens − 1) / (last − first "
        "token); aggregate = all tokens / (last stream done − first request sent). *Same text*: "
        "requests whose text with speculation equals the text without.",
    ]
    return "\n".join(lines) + "\n"


# --- the cost table ---------------------------------------------------------------------------

COST_TOKENS = [*range(1, 17), 20, 24, 32, 48, 64]
# With several rows: the positions of a verify step up to the default max_draft (1 + 8).
COST_POSITIONS_ROWS = list(range(1, 10))


def cost_positions(rows: int) -> list[int]:
    return COST_TOKENS if rows == 1 else COST_POSITIONS_ROWS


def cost_child(model_path: str, reps: int, rows: int) -> None:
    """In a child with the worker's BLAS: one forward pass of `rows` rows per count of
    positions, interleaved."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = load(model_path)
    cache = make_prompt_cache(model)
    mx.eval(model(mx.random.randint(0, 1000, (rows, 600)), cache=cache))
    times: dict[int, list[float]] = {n: [] for n in cost_positions(rows)}
    for _ in range(reps):
        for n in cost_positions(rows):
            tokens = mx.random.randint(0, 1000, (rows, n))
            mx.eval(tokens)
            start = time.perf_counter()
            logits = model(tokens, cache=cache)
            mx.eval((logits - mx.logsumexp(logits, axis=-1, keepdims=True)).argmax(-1))
            times[n].append(time.perf_counter() - start)
            for layer in cache:
                layer.trim(n)
    print(json.dumps({n: statistics.median(v) for n, v in times.items()}))


def cost_table(args: argparse.Namespace) -> int:
    model, blas = model_and_blas(args)  # puts this checkout first on sys.path
    from jupyter_lmsp.engine.speculative import SpeculationSettings, StepCosts

    prior = StepCosts(SpeculationSettings()).prior

    out = subprocess.run(
        [sys.executable, __file__, "--cost-child", str(model), str(args.rounds), str(args.rows)],
        env=blas.worker_environment(),
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    seconds = {int(k): v for k, v in json.loads(out.strip().splitlines()[-1]).items()}
    rows = args.rows
    relative = {n: seconds[n] / seconds[1] for n in cost_positions(rows)}
    lines = [
        f"# Step costs: one forward pass of {rows} row(s) x n positions, in passes of one",
        "",
        f"`benchmarks/bench_speculative.py {_flags(meta_args(args))}`, "
        f"{time.strftime('%Y-%m-%d %H:%M')}, BLAS {blas.name}, one token = "
        f"{seconds[1] * 1000:.1f} ms, 600 tokens of context, medians of {args.rounds} "
        f"interleaved repetitions, load average {os.getloadavg()[0]:.1f}.",
        "",
        f"| positions | measured | prior (`StepCosts.prior`, {rows} row(s)) |",
        "|---:|---:|---:|",
    ]
    for n in cost_positions(rows):
        lines.append(f"| {n} | {relative[n]:.2f} | {prior(rows, n - 1):.2f} |")
    lines.append("")
    args.out.mkdir(parents=True, exist_ok=True)
    name = "step_costs" if rows == 1 else f"step_costs_rows{rows}"
    (args.out / f"{name}.md").write_text("\n".join(lines))
    (args.out / f"{name}.json").write_text(
        json.dumps({"args": meta_args(args), "seconds": seconds, "relative": relative}, indent=1)
    )
    print("\n".join(lines))
    return 0


def meta_args(args: argparse.Namespace) -> dict[str, Any]:
    return {
        k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "cost_child"
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--tokens", type=int, default=256, help="output tokens per stream, at most")
    parser.add_argument(
        "--rounds", type=int, default=5, help="interleaved rounds (>= 5 for figures)"
    )
    parser.add_argument("--streams", type=int, default=8, help="concurrent streams on (a)")
    parser.add_argument(
        "--max-draft", type=int, default=0, help="LMSPExtension.speculative_max_draft (0: default)"
    )
    parser.add_argument(
        "--max-rows", type=int, default=0, help="LMSPExtension.speculative_max_rows (0: default)"
    )
    parser.add_argument(
        "--no-learn-costs",
        action="store_true",
        help="the speculating service with LMSPExtension.speculative_learn_costs=False (its "
        "decisions from the cost prior alone)",
    )
    parser.add_argument(
        "--blas-threads", type=int, default=1, help="OPENBLAS_NUM_THREADS for all (0: default)"
    )
    parser.add_argument("--blas-coretype", default="", help="OPENBLAS_CORETYPE for all")
    parser.add_argument("--blas-candidates", nargs="+", default=[])
    parser.add_argument(
        "--cost-table",
        action="store_true",
        help="measure the forward-pass cost by tokens fed (the prior of the cost model) instead",
    )
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument(
        "--rows",
        type=int,
        default=1,
        help="with --cost-table: rows per step (1: step_costs.md; else step_costs_rowsN.md)",
    )
    parser.add_argument("--cost-child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.cost_child:
        cost_child(args.cost_child[0], int(args.cost_child[1]), int(args.cost_child[2]))
        return 0
    if args.cost_table:
        return cost_table(args)
    started = time.monotonic()
    results = run(args)
    summary = summarize(results)
    report = render(results, summary)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "speculative.md").write_text(report)
    (args.out / "speculative.json").write_text(
        json.dumps({**results, "summary": summary}, indent=1)
    )
    print(report)
    log(f"done in {time.monotonic() - started:.0f} s; wrote {args.out}/speculative.{{md,json}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
