"""Prefill fairness (issue 43): how long a long prompt pauses another client's stream.

One command, on the demo model (SmolLM2-135M-Instruct, converted on first use):

    .venv/bin/python benchmarks/bench_prefill_fairness.py

The inference worker itself (`EngineClient`, the BLAS the probe chooses for one thread), no
HTTP. Each round: job A (a short prompt, greedy, many tokens) decodes alone for a while: its
token gaps give one decode step (median). Then job B arrives with a ~`--prompt-tokens` prompt
(a nonce first: the prompt cache never helps); while B's prompt is prefilled in 128-token
chunks beside A's decode steps, A's longest gap is recorded, and B's prefill time divided by
its chunks gives one chunk. The target: A's longest pause <= 2 decode steps + 1 prefill chunk.

Writes `benchmarks/results/prefill_fairness.md` and `.json`. Options: `--help`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import threading
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PREFILL_STEP = 128  # jupyter_lmsp.engine.batching.DEFAULT_PREFILL_STEP
FILLER = (
    "The library opens at nine in the morning and closes at six in the evening, except on "
    "Sundays when it is closed and on Thursdays when it stays open until nine. "
)


class Timed:
    """The worker's messages with the time each arrived."""

    def __init__(self) -> None:
        self.items: list[tuple[float, object]] = []
        self.cond = threading.Condition()

    def __call__(self, message: object) -> None:
        from jupyter_lmsp.engine.messages import StepTokens

        now = time.monotonic()
        rows = message.rows if isinstance(message, StepTokens) else [message]
        with self.cond:
            self.items.extend((now, row) for row in rows)
            self.cond.notify_all()

    def wait(self, predicate: Any, timeout: float = 600.0) -> tuple[float, object]:
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                for at, message in self.items:
                    if predicate(message):
                        return at, message
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("no such message")
                self.cond.wait(left)


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
    client.submit(GenerateJob(job_id=a, model_path=str(model), messages=story, max_tokens=2000))

    def a_tokens() -> list[float]:
        with timed.cond:
            return [t for t, m in timed.items if isinstance(m, JobTokens) and m.job_id == a]

    # A decodes alone for a while: its steps.
    timed.wait(lambda m: isinstance(m, JobTokens) and m.job_id == a)
    while len(a_tokens()) < 25:
        time.sleep(0.05)
    alone = a_tokens()
    step = statistics.median(y - x for x, y in itertools.pairwise(alone))
    # Then B's long prompt.
    # ~1.14 tokens a word for this filler with SmolLM2's tokenizer (/1.3 gave 5,275 tokens).
    words = max(1, int(prompt_tokens / 1.14))
    text = (FILLER * (words // len(FILLER.split()) + 1)).split()[:words]
    long = [{"role": "user", "content": uuid.uuid4().hex + " " + " ".join(text) + " Sum up."}]
    sent = time.monotonic()
    client.submit(GenerateJob(job_id=b, model_path=str(model), messages=long, max_tokens=4))
    _, started = timed.wait(lambda m: isinstance(m, JobStarted) and m.job_id == b)
    first_b, _ = timed.wait(lambda m: isinstance(m, JobTokens) and m.job_id == b)
    during = [t for t in a_tokens() if sent <= t <= first_b]
    gaps = [y - x for x, y in itertools.pairwise(during)]
    real_prompt = started.input_tokens  # type: ignore[attr-defined]
    chunks = max(1, -(-real_prompt // PREFILL_STEP))
    chunk = (first_b - sent) / chunks
    client.cancel(a)
    timed.wait(lambda m: isinstance(m, JobFinished | JobFailed) and m.job_id == b)
    longest = max(gaps) if gaps else first_b - sent
    return {
        "prompt_tokens": real_prompt,
        "decode_step_s": step,
        "prefill_chunk_s": chunk,
        "prefill_s": first_b - sent,
        "a_tokens_during_prefill": len(during),
        "longest_pause_s": longest,
        # A's pauses early and late in B's prefill: a chunk's cost grows with its position.
        "early_pause_s": statistics.median(gaps[:5]) if gaps else longest,
        "late_pause_s": statistics.median(gaps[-5:]) if gaps else longest,
        "bound_s": 2 * step + chunk,
        "within": longest <= 2 * step + chunk,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=6000)
    parser.add_argument("--model-dir", type=Path, default=Path.home() / ".cache/jupyter-lmsp")
    args = parser.parse_args()

    from jupyter_lmsp.engine.blas import choose_blas
    from jupyter_lmsp.engine.client import EngineClient
    from jupyter_lmsp.engine.messages import WorkerReady
    from jupyter_lmsp.models.demo import ensure_demo_model

    model = ensure_demo_model(args.model_dir / "models")
    blas = choose_blas(threads=1)
    timed = Timed()
    client = EngineClient(timed, env=blas.env)
    client.start()
    timed.wait(lambda m: isinstance(m, WorkerReady), 120)
    rounds = []
    try:
        for i in range(args.rounds):
            found = one_round(client, timed, model, args.prompt_tokens)
            rounds.append(found)
            print(f"round {i + 1}: {json.dumps(found)}", flush=True)
    finally:
        client.stop()

    def spread(key: str) -> str:
        values = [r[key] for r in rounds]
        return (
            f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"
            if values
            else "-"
        )

    out = HERE / "results"
    out.mkdir(exist_ok=True)
    summary = {
        "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "machine": platform.machine(),
        "blas": blas.name if hasattr(blas, "name") else str(blas),
        "rounds": rounds,
    }
    (out / "prefill_fairness.json").write_text(json.dumps(summary, indent=2))
    lines = [
        "# Prefill fairness (issue 43)",
        "",
        f"{summary['when']}, {summary['machine']}, demo model, {len(rounds)} rounds, "
        f"~{args.prompt_tokens}-token prompt beside one decoding job; median (min-max), s.",
        "",
        "| measure | value |",
        "| --- | --- |",
        f"| decode step (job A alone) | {spread('decode_step_s')} |",
        f"| prefill chunk (128 tokens, beside A) | {spread('prefill_chunk_s')} |",
        f"| whole prefill of B | {spread('prefill_s')} |",
        f"| A's pauses, first 5 of B's chunks (median) | {spread('early_pause_s')} |",
        f"| A's pauses, last 5 of B's chunks (median) | {spread('late_pause_s')} |",
        f"| A's longest pause while B prefills | {spread('longest_pause_s')} |",
        f"| bound: 2 steps + 1 chunk | {spread('bound_s')} |",
        f"| rounds within the bound | {sum(r['within'] for r in rounds)} of {len(rounds)} |",
    ]
    (out / "prefill_fairness.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
