"""Cancel benchmark: how soon a cancelled task's slot is free, during decode and during prefill.

One command, on the demo model (SmolLM2-135M-Instruct, converted on first use):

    .venv/bin/python benchmarks/bench_cancel.py

A real `jupyter server` with this extension (`LMSPServerProcess`, as the tests start theirs)
runs with `--LMSPExtension.max_batch_size=1`, so a second task waits `queued` until the first
one's slot is free. Each round, on fresh prompts (a nonce first, so the prompt cache never
helps):

1. **step**: a greedy task of `--tokens` tokens streamed to the end: one decode step =
   (last delta − first delta) / (the worker's forward steps in that time). The steps are
   counted from the service's own `lmsp_batch_size_count` (one observation per forward step,
   read from `/lmsp/v1/metrics` before and after), less the prefill step before the first
   token. Speculative decoding (on by default) emits several tokens from one verify step, so
   the time per *token* is shorter than the step a cancel may find in flight; the time per
   token is reported beside it;
2. **chunk**: a task with a ~`--prompt-tokens` prompt run to its first token: one prefill chunk
   = (first delta − in_progress) / the number of 128-token chunks of its prompt;
3. **decode**: a long task decoding, a short one queued behind it; the first is cancelled
   (`POST /responses/{id}/cancel`) after `--decode-tokens` deltas;
4. **prefill**: a task with a ~`--prompt-tokens` prompt, a short one queued; the first is
   cancelled `--prefill-wait` seconds after it went `in_progress` (its prompt being read).

Measured from the moment the cancel request is sent: the cancel's HTTP answer, the first
task's `response.cancelled` event, the second task's `response.loading` (the runner gave it
the slot) and `response.in_progress` (the worker admitted it: the slot is free). Targets:
cancel → next task in progress ≤ one decode step during decode, ≤ one prefill chunk during
prefill (both measured in the same round).

Writes `benchmarks/results/cancel.md` and `cancel.json`. Options: `--help`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
DEFAULT_MODEL_DIR = Path.home() / ".cache" / "jupyter-lmsp" / "models"
TOKEN = "lmsp-bench-token"
PREFILL_STEP = 128  # jupyter_lmsp.engine.batching.DEFAULT_PREFILL_STEP

STORY = "Write a long story about a lighthouse keeper who finds a message in a bottle."
FILLER = (
    "The library opens at nine in the morning and closes at six in the evening, except on "
    "Sundays when it is closed and on Thursdays when it stays open until nine. Members may "
    "borrow up to eight books, four magazines and two films at a time. "
)


@dataclass
class Watch:
    """A task's events as they arrive: the first arrival time of each type, and the deltas."""

    task_id: str
    times: dict[str, float] = field(default_factory=dict)
    deltas: list[float] = field(default_factory=list)
    final: dict[str, Any] = field(default_factory=dict)
    done: threading.Event = field(default_factory=threading.Event)

    def wait(self, kind: str, timeout: float = 600) -> float:
        deadline = time.monotonic() + timeout
        while kind not in self.times:
            if time.monotonic() > deadline or (self.done.is_set() and kind not in self.times):
                raise RuntimeError(f"{self.task_id}: no {kind} (saw {sorted(self.times)})")
            time.sleep(0.002)
        return self.times[kind]

    def wait_deltas(self, n: int, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while len(self.deltas) < n:
            if time.monotonic() > deadline or self.done.is_set():
                raise RuntimeError(f"{self.task_id}: only {len(self.deltas)} deltas")
            time.sleep(0.002)


TERMINAL = ("response.completed", "response.incomplete", "response.failed", "response.cancelled")


class Service:
    def __init__(self, model: Path, data_dir: Path, threads: str | None) -> None:
        from jupyter_lmsp.client.sandbox import LMSPServerProcess

        traits: dict[str, Any] = {"model_dir": model.parent, "max_batch_size": 1}
        if threads:
            traits["blas_threads"] = threads
        self.server = LMSPServerProcess(
            data_dir, token=TOKEN, default_model=model.name, traits=traits
        ).start(timeout=180)
        self.client = httpx.Client(
            base_url=self.server.api, headers=self.server.headers, timeout=60
        )

    def create(self, messages: list[dict[str, str]], max_tokens: int) -> Watch:
        body = {
            "input": messages,
            "max_output_tokens": max_tokens,
            "temperature": 0.0,
            "background": True,
            "store": True,
        }
        response = self.client.post("/responses", json=body)
        response.raise_for_status()
        created = response.json()
        watch = Watch(created["task_id"])
        watch.final["id"] = created["id"]
        threading.Thread(target=self._follow, args=(watch,), daemon=True).start()
        return watch

    def _follow(self, watch: Watch) -> None:
        with (
            httpx.Client(
                base_url=self.server.api, headers=self.server.headers, timeout=None
            ) as client,
            client.stream(
                "GET", f"/tasks/{watch.task_id}/events", params={"stream": "true"}
            ) as response,
        ):
            event = None
            for line in response.iter_lines():
                if line.startswith("event:"):
                    event = line[6:].strip()
                elif line.startswith("data:") and event:
                    now = time.perf_counter()
                    watch.times.setdefault(event, now)
                    if event == "response.output_text.delta":
                        watch.deltas.append(now)
                    if event in TERMINAL:
                        watch.final.update(json.loads(line[5:]).get("response", {}))
                        break
        watch.done.set()

    def cancel(self, watch: Watch) -> float:
        response = self.client.post(f"/responses/{watch.final['id']}/cancel")
        response.raise_for_status()
        return time.perf_counter()

    def close(self) -> None:
        self.client.close()
        self.server.stop()


def chat(text: str, nonce: str) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": f"Session {nonce}. You are a helpful assistant."},
        {"role": "user", "content": text},
    ]


def long_prompt(tokens: int, nonce: str) -> list[dict[str, str]]:
    # ~44 tokens per repetition of FILLER with SmolLM2's tokenizer.
    return chat(FILLER * max(1, tokens // 44) + "\nSummarise the rules above.", nonce)


def forward_steps(service: Service) -> float:
    """The worker's forward steps so far: `lmsp_batch_size` is observed once per step."""
    from prometheus_client.parser import text_string_to_metric_families

    response = service.client.get("/metrics")
    response.raise_for_status()
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name == "lmsp_batch_size_count":
                return sample.value
    return 0.0


def measure_step(service: Service, tokens: int, nonce: str) -> tuple[float, float]:
    """(one forward decode step, time per output token), in seconds."""
    before = forward_steps(service)
    watch = service.create(chat(STORY, nonce), tokens)
    watch.done.wait(600)
    # Reported with the next tokens: give the last step's figure time to reach the runner.
    time.sleep(0.2)
    steps = forward_steps(service) - before
    produced = (watch.final.get("usage") or {}).get("output_tokens", 0)
    if produced < 3 or len(watch.deltas) < 2 or steps < 3:
        raise RuntimeError(f"step measurement produced {produced} tokens in {steps} steps")
    span = watch.deltas[-1] - watch.deltas[0]
    # Less the prefill step and the step of the first token: the steps between the first and
    # the last delta. Counting one step too many (tokens coalesced into one delta) only makes
    # the step shorter and the target harder.
    return span / max(1.0, steps - 2), span / (produced - 1)


def measure_chunk(service: Service, prompt_tokens: int, nonce: str) -> tuple[float, int]:
    watch = service.create(long_prompt(prompt_tokens, nonce), 2)
    started = watch.wait("response.in_progress")
    first = watch.wait("response.output_text.delta")
    watch.done.wait(600)
    prompt = (watch.final.get("usage") or {}).get("input_tokens", 0)
    chunks = max(1, -(-(prompt - 1) // PREFILL_STEP))
    return (first - started) / chunks, prompt


def measure_cancel(service: Service, first: Watch, then: Watch, sent: float) -> dict[str, float]:
    answered = service.cancel(first)
    cancelled = first.wait("response.cancelled") - sent
    loading = then.wait("response.loading") - sent
    running = then.wait("response.in_progress") - sent
    then.done.wait(600)
    return {
        "answered": answered - sent,
        "cancelled": cancelled,
        "next_loading": loading,
        "next_in_progress": running,
    }


def cancel_during_decode(service: Service, nonce: str, after: int) -> dict[str, float]:
    first = service.create(chat(STORY, nonce), 1024)
    first.wait_deltas(after)
    then = service.create(chat("What is the capital of France?", nonce + "b"), 2)
    time.sleep(0.2)  # queued behind the first
    if "response.loading" in then.times:
        raise RuntimeError("the second task was not queued: is max_batch_size 1?")
    return measure_cancel(service, first, then, time.perf_counter())


def cancel_during_prefill(
    service: Service, nonce: str, prompt_tokens: int, wait: float
) -> dict[str, float]:
    first = service.create(long_prompt(prompt_tokens, nonce), 8)
    first.wait("response.in_progress")
    then = service.create(chat("What is the capital of France?", nonce + "b"), 2)
    time.sleep(wait)
    if "response.output_text.delta" in first.times:
        raise RuntimeError("the prompt was read before the cancel: raise --prompt-tokens")
    return measure_cancel(service, first, then, time.perf_counter())


def spread(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0] * 1000:.0f}"
    return (
        f"{statistics.median(values) * 1000:.0f} "
        f"({min(values) * 1000:.0f}–{max(values) * 1000:.0f})"
    )


def _flags(args: dict[str, str]) -> str:
    """The options a result was measured with (not where the model and results live)."""
    return " ".join(
        f"--{name.replace('_', '-')} {value}"
        for name, value in args.items()
        if name not in ("model_dir", "out")
    )


def render(meta: dict[str, Any], rounds: list[dict[str, Any]]) -> str:
    step = [r["step"] for r in rounds]
    chunk = [r["chunk"] for r in rounds]
    lines = [
        "# Cancel benchmark",
        "",
        f"`benchmarks/bench_cancel.py {_flags(meta.get('args', {}))}`, {meta['started']} – "
        f"{meta['finished']}. Model "
        f"`{meta['model']}`, greedy, `max_batch_size=1` (the next task waits for the slot), "
        f"{len(rounds)} round(s), median (min–max), milliseconds. Machine: {meta['cpus']} CPUs, "
        f"{meta['platform']}, load average {meta['load_before'][0]:.1f} before / "
        f"{meta['load_after'][0]:.1f} after.",
        "",
        f"One decode step (a forward pass): {spread(step)} ms; time per output token "
        f"{spread([r['per_token'] for r in rounds])} ms (shorter when speculative drafts are "
        f"accepted). One prefill chunk ({PREFILL_STEP} tokens of a "
        f"{statistics.median(r['prompt_tokens'] for r in rounds):.0f}-token prompt): "
        f"{spread(chunk)} ms.",
        "",
        "| cancel during | cancel answered | task cancelled | next task loading "
        "| next task in progress (slot free) | target | slot free / target |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for phase, target_key, target_name in (
        ("decode", "step", "one decode step"),
        ("prefill", "chunk", "one prefill chunk"),
    ):
        rows = [r[phase] for r in rounds]
        ratios = [r[phase]["next_in_progress"] / r[target_key] for r in rounds]
        lines.append(
            f"| {phase} | {spread([x['answered'] for x in rows])} "
            f"| {spread([x['cancelled'] for x in rows])} "
            f"| {spread([x['next_loading'] for x in rows])} "
            f"| {spread([x['next_in_progress'] for x in rows])} "
            f"| {target_name} | {statistics.median(ratios):.2f}× "
            f"(max {max(ratios):.2f}×) |"
        )
    lines += [
        "",
        "Times from the cancel request being sent. *Slot free* = the queued task's "
        "`response.in_progress` event: the worker admitted it, so the cancelled task's row is "
        "gone. It includes the part of the step in flight that ran before the worker's next "
        "checkpoint (a step whose jobs are all cancelled is abandoned at the end of a third of "
        "the model's layers), the runner committing the cancel and dispatching the next task, "
        "and that task's admission. Target ≤ 1.0×.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=48, help="tokens of the step measurement")
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--decode-tokens", type=int, default=8, help="deltas before the cancel")
    parser.add_argument("--prefill-wait", type=float, default=1.0, help="seconds into the prefill")
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--blas-threads", default=os.environ.get("OPENBLAS_NUM_THREADS", "1"))
    args = parser.parse_args()

    from jupyter_lmsp.models.demo import ensure_demo_model

    model = ensure_demo_model(args.model_dir)
    meta: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%d %H:%M"),
        "model": model.name,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "load_before": os.getloadavg(),
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        service = Service(model, Path(tmp), args.blas_threads)
        try:
            service.create(chat("Hi", "warm-up"), 2).done.wait(600)
            for i in range(args.rounds):
                nonce = uuid.uuid4().hex[:8]
                step, per_token = measure_step(service, args.tokens, nonce + "s")
                chunk, prompt = measure_chunk(service, args.prompt_tokens, nonce + "c")
                decode = cancel_during_decode(service, nonce + "d", args.decode_tokens)
                prefill = cancel_during_prefill(
                    service, nonce + "p", args.prompt_tokens, args.prefill_wait
                )
                rounds.append(
                    {
                        "step": step,
                        "per_token": per_token,
                        "chunk": chunk,
                        "prompt_tokens": prompt,
                        "decode": decode,
                        "prefill": prefill,
                    }
                )
                print(f"round {i + 1}: {json.dumps(rounds[-1])}", flush=True)
        finally:
            service.close()
    meta["finished"] = time.strftime("%Y-%m-%d %H:%M")
    meta["load_after"] = os.getloadavg()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cancel.json").write_text(json.dumps({"meta": meta, "rounds": rounds}, indent=1))
    report = render(meta, rounds)
    (args.out / "cancel.md").write_text(report)
    print(report)


if __name__ == "__main__":
    main()
