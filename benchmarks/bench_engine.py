"""Engine benchmark: the LMSP service against bare mlx-lm and `mlx_lm.server`, side by side.

One command, on the demo model (SmolLM2-135M-Instruct, converted on first use):

    .venv/bin/python benchmarks/bench_engine.py

It starts three things and measures them in interleaved rounds, so a change in machine load
hits all of them alike:

- **bare**: `mlx_lm.stream_generate` in a child process (no server at all): the ceiling;
- **mlx_lm.server**: mlx-lm's own HTTP server, streaming from `/v1/chat/completions`;
- **service**: a real `jupyter server` with this extension, streaming `POST /lmsp/v1/responses`
  (every token goes through the worker process, the SQLite store and SSE).

All three run MLX on the BLAS the probe chooses (`jupyter_lmsp.engine.blas.choose_blas`: the
service's worker gets it from the extension, the other two from this script; `--blas-coretype
Haswell` masks AVX-512 for all of them, `--blas-candidates` restricts the choice), greedy, 64
tokens. `--mlx-server-blas stock` runs mlx_lm.server on the BLAS `pip install mlx-lm` gives it.

Measured:
1. single stream: time to first token and decode rate, (tokens - 1) / (last - first token time),
   and end-to-end rate, tokens / request time;
2. aggregate tokens/s at 1, 4 and 8 concurrent streams (all tokens / wall time from the first
   request sent to the last one done), different prompts per stream;
3. the ceiling at each concurrency level, with no server at all (`bench_forward.py`'s
   measurement, in a child with the same BLAS, in the same rounds): one forward step of that
   many sequences, and their prefill; so the table shows how far above mlx_lm.server any server
   could get here;
4. a second chat turn's time to first token: *warm* right after the first turn (the service
   continues it with `previous_response_id`; mlx_lm.server gets the whole conversation again,
   as its clients do), *cold* for the same conversation under a system prompt never seen before.

Writes `benchmarks/results/engine.md` (tables), `engine.json` (raw samples) and `engine.png`.
Options: `--help`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from bench_forward import measure_in_child

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DEFAULT_MODEL_DIR = Path.home() / ".cache" / "jupyter-lmsp" / "models"
TOKEN = "lmsp-bench-token"

SYSTEM = "You are a helpful assistant."
# Prompts that make SmolLM2 write at length, so every stream reaches max_tokens.
STORY_PROMPTS = [
    "Write a long story about a lighthouse keeper who finds a message in a bottle.",
    "Write a long story about a robot learning to paint.",
    "Write a detailed essay about the history of bridges.",
    "Write a long story about two friends sailing around the world.",
    "Explain in detail how a steam engine works, step by step.",
    "Write a long story about a dragon who is afraid of the dark.",
    "Write a detailed guide to growing tomatoes in a small garden.",
    "Write a long story about a city that floats in the clouds.",
]
# A long system prompt for the second-turn test (~550 tokens), so prefill dominates cold TTFT.
HANDBOOK = " ".join(
    [
        "You are the assistant of a small public library in a mountain town.",
        "The library opens at nine in the morning and closes at six in the evening,",
        "except on Sundays when it is closed and on Thursdays when it stays open until nine.",
        "Members may borrow up to eight books, four magazines and two films at a time.",
        "Books are lent for three weeks, magazines for one week and films for three days.",
        "Loans can be renewed twice online or at the desk unless another member reserved them.",
        "Late returns cost ten cents a day per item, capped at five dollars per item.",
        "Children's books never incur late fees. Lost items are charged at replacement cost.",
        "The reading room on the first floor is silent; the garden room allows quiet talk.",
        "Group study rooms can be booked for two hours a day, up to a week in advance.",
        "Printing costs ten cents a page in black and white and fifty cents in colour.",
        "The local history archive is open on Tuesdays and Fridays from two to five.",
        "Volunteers run a reading club for teenagers every second Wednesday at four.",
        "Story time for toddlers is on Monday and Saturday mornings at ten thirty.",
        "The library lends snowshoes, telescopes and sewing machines to adult members.",
        "Wi-Fi is free; the network name is MountainLibrary and no password is needed.",
    ]
    * 2
)
FIRST_QUESTION = "When does the library open on Thursdays, and how long can I keep a film?"
SECOND_QUESTION = "Thanks. And what does it cost if I return that film two days late?"


# --- samples ----------------------------------------------------------------------------------


@dataclass
class Sample:
    """One streamed request, timed by the client (seconds; absolute times are perf_counter)."""

    sent: float
    first: float | None
    last: float | None
    done: float
    tokens: int
    cached_tokens: int | None = None

    @property
    def ttft(self) -> float:
        return (self.first if self.first is not None else self.done) - self.sent

    @property
    def decode_tps(self) -> float:
        if self.first is None or self.last is None or self.last <= self.first:
            return float("nan")
        return (self.tokens - 1) / (self.last - self.first)

    @property
    def e2e_tps(self) -> float:
        return self.tokens / (self.done - self.sent)


def aggregate_tps(samples: list[Sample]) -> float:
    return sum(s.tokens for s in samples) / (
        max(s.done for s in samples) - min(s.sent for s in samples)
    )


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def chat(question: str, system: str = SYSTEM) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def story(i: int, nonce: str) -> list[dict[str, str]]:
    """A story prompt no earlier request had, so no prompt cache holds more than its start."""
    return chat(f"{STORY_PROMPTS[i % len(STORY_PROMPTS)]} (Request {nonce}-{i}.)")


# --- targets ----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def iter_sse(response: httpx.Response) -> Iterator[tuple[str | None, str]]:
    """(event, data) pairs of a server-sent event stream."""
    event: str | None = None
    data: list[str] = []
    for line in response.iter_lines():
        if not line:
            if data:
                yield event, "\n".join(data)
            event, data = None, []
        elif line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].strip())
    if data:
        yield event, "\n".join(data)


class BareTarget:
    """`mlx_lm.stream_generate` in a child process with the chosen BLAS's environment.

    The child reads one JSON request per line on stdin and answers with one JSON line of
    durations measured around `stream_generate` itself.
    """

    name = "bare mlx_lm.stream_generate"

    def __init__(self, model: Path, env: dict[str, str] | None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--bare-child", str(model)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        ready = self._read()
        self.blas = ready["blas"]

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the bare mlx-lm child exited")
        return json.loads(line)

    def stream(self, messages: list[dict[str, str]], max_tokens: int) -> Sample:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"messages": messages, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        r = self._read()
        return Sample(0.0, r["ttft"], r["last"], r["total"], r["tokens"])

    def close(self) -> None:
        with contextlib.suppress(Exception):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        if self.proc.poll() is None:
            self.proc.kill()


def bare_child(model_path: str) -> None:
    """The child side of `BareTarget`."""
    import mlx.core as mx
    from mlx_lm import load, stream_generate
    from mlx_lm.sample_utils import make_sampler

    sys.path.insert(0, str(REPO))
    from jupyter_lmsp.engine.worker import _detect_blas

    model, tokenizer = load(model_path)
    mx.random.seed(0)
    print(json.dumps({"blas": _detect_blas()}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        prompt = tokenizer.apply_chat_template(request["messages"], add_generation_prompt=True)
        start = time.perf_counter()
        first = last = None
        tokens = 0
        for response in stream_generate(
            model,
            tokenizer,
            prompt,
            max_tokens=request["max_tokens"],
            sampler=make_sampler(0.0),
        ):
            if response.finish_reason == "stop" and response.token in tokenizer.eos_token_ids:
                break
            now = time.perf_counter()
            first = now if first is None else first
            last = now
            tokens += 1
        total = time.perf_counter() - start
        print(
            json.dumps(
                {
                    "ttft": (first or start) - start,
                    "last": (last or start) - start,
                    "total": total,
                    "tokens": tokens,
                }
            ),
            flush=True,
        )


class MlxServerTarget:
    """`python -m mlx_lm.server` with the chosen BLAS's environment, OpenAI chat endpoint."""

    name = "mlx_lm.server"

    def __init__(self, model: Path, env: dict[str, str] | None, log_dir: Path) -> None:
        self.port = free_port()
        self.log = open(log_dir / "mlx_lm_server.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mlx_lm.server",
                "--model",
                str(model),
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--max-tokens",
                "64",
                "--log-level",
                "WARNING",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=300)
        wait_until(lambda: self.client.get("/v1/models").status_code == 200, self.proc)

    def stream(self, messages: list[dict[str, str]], max_tokens: int) -> Sample:
        return self.stream_with_text(messages, max_tokens)[0]

    def stream_with_text(
        self, messages: list[dict[str, str]], max_tokens: int
    ) -> tuple[Sample, str]:
        body = {
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        sent = time.perf_counter()
        first = last = None
        text: list[str] = []
        usage: dict[str, Any] | None = None
        with self.client.stream("POST", "/v1/chat/completions", json=body) as response:
            response.raise_for_status()
            for _event, data in iter_sse(response):
                if data == "[DONE]":
                    break
                payload = json.loads(data)
                usage = payload.get("usage") or usage
                for choice in payload.get("choices", []):
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        now = time.perf_counter()
                        first = now if first is None else first
                        last = now
                        text.append(content)
        done = time.perf_counter()
        tokens = usage["completion_tokens"] if usage else len(text)
        cached = None
        if usage and usage.get("prompt_tokens_details"):
            cached = usage["prompt_tokens_details"].get("cached_tokens")
        return Sample(sent, first, last, done, tokens, cached), "".join(text)

    def close(self) -> None:
        self.client.close()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


class ServiceTarget:
    """A `jupyter server` with jupyter_lmsp: `POST /lmsp/v1/responses` with `stream: true`."""

    name = "LMSP service"

    def __init__(
        self, model: Path, data_dir: Path, max_batch_size: int, blas_traits: dict[str, Any]
    ) -> None:
        from jupyter_lmsp.client.sandbox import LMSPServerProcess

        traits: dict[str, Any] = {
            "model_dir": model.parent,
            "max_batch_size": max_batch_size,
            **blas_traits,
        }
        if os.environ.get("OPENBLAS_NUM_THREADS"):
            # The same thread count as the other two (the service otherwise picks its own).
            traits["blas_threads"] = os.environ["OPENBLAS_NUM_THREADS"]
        self.server = LMSPServerProcess(
            data_dir, token=TOKEN, default_model=model.name, traits=traits
        ).start(timeout=180)
        self.client = httpx.Client(
            base_url=self.server.api, headers=self.server.headers, timeout=300
        )

    def service(self) -> dict[str, Any]:
        return self.client.get("/service").json()

    def stream(
        self,
        messages: list[dict[str, str]],
        max_tokens: int,
        previous_response_id: str | None = None,
    ) -> Sample:
        return self.stream_with_id(messages, max_tokens, previous_response_id)[0]

    def stream_with_id(
        self,
        messages: list[dict[str, str]],
        max_tokens: int,
        previous_response_id: str | None = None,
    ) -> tuple[Sample, str, str]:
        body: dict[str, Any] = {
            "input": messages,
            "max_output_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
        }
        if previous_response_id is not None:
            body["previous_response_id"] = previous_response_id
        sent = time.perf_counter()
        first = last = None
        final: dict[str, Any] = {}
        text: list[str] = []
        with self.client.stream("POST", "/responses", json=body) as response:
            response.raise_for_status()
            for event, data in iter_sse(response):
                if not data or event is None:
                    continue
                payload = json.loads(data)
                kind = payload.get("type", event)
                if kind == "response.output_text.delta":
                    now = time.perf_counter()
                    first = now if first is None else first
                    last = now
                    text.append(payload["delta"])
                elif kind in ("response.completed", "response.incomplete", "response.failed"):
                    final = payload["response"]
                    break
        done = time.perf_counter()
        if final.get("status") == "failed" or not final:
            raise RuntimeError(f"the service failed: {final}")
        usage = final.get("usage") or {}
        cached = (usage.get("input_tokens_details") or {}).get("cached_tokens")
        sample = Sample(sent, first, last, done, usage.get("output_tokens", 0), cached)
        return sample, final["id"], "".join(text)

    def close(self) -> None:
        self.client.close()
        self.server.stop()


def wait_until(ready: Callable[[], bool], proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:3]} exited with {proc.returncode}")
        with contextlib.suppress(httpx.TransportError):
            if ready():
                return
        time.sleep(0.2)
    raise RuntimeError(f"{proc.args[:3]} did not come up")


def release_together(calls: list[Callable[[], Any]]) -> list[Any]:
    """Every call in a thread of its own, released together (a barrier); their results in
    order, or the first error raised."""
    barrier = threading.Barrier(len(calls))
    out: list[Any] = [None] * len(calls)
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            barrier.wait()
            out[i] = calls[i]()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def concurrently(
    stream: Callable[[list[dict[str, str]], int], Sample], n: int, max_tokens: int
) -> list[Sample]:
    """n streams at once, each its own (never seen) prompt, released together."""
    nonce = uuid.uuid4().hex[:6]
    samples = release_together([lambda i=i: stream(story(i, nonce), max_tokens) for i in range(n)])
    return [s for s in samples if s is not None]


# --- the run ----------------------------------------------------------------------------------


@dataclass
class Results:
    meta: dict[str, Any] = field(default_factory=dict)
    single: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    concurrent: dict[str, dict[int, list[list[dict[str, Any]]]]] = field(default_factory=dict)
    turns: dict[str, dict[str, list[dict[str, Any]]]] = field(default_factory=dict)
    # Concurrency level -> the forward pass measured in each round: {"step_ms", "prefill_ms"}.
    ceiling: dict[int, list[dict[str, float]]] = field(default_factory=dict)


def as_dict(sample: Sample) -> dict[str, Any]:
    return {
        **asdict(sample),
        "ttft": sample.ttft,
        "decode_tps": sample.decode_tps,
        "e2e_tps": sample.e2e_tps,
    }


def forward_pass(model: Path, env: dict[str, str] | None, batch: int) -> dict[str, float]:
    """One decode step and one prefill of `batch` sequences with no server, in ms.

    `bench_forward.py`'s measurement (mlx-lm's BatchKVCache, pipelined as mlx-lm's decoders
    run it; the prefill of ~14 new tokens per sequence after a cached prefix, like these
    rounds' prompts), in a child process started with `env`.
    """
    measured = measure_in_child(model, dict(env or os.environ), batch)
    return {"step_ms": measured["step_ms"], "prefill_ms": measured["prefill_ms"]}


def ceilings(passes: list[dict[str, float]], streams: int, tokens: int) -> tuple[float, float]:
    """(decode ceiling, bound with prefill) in tokens/s, from the median forward pass.

    Decode ceiling: streams / step. Bound: all tokens / (prefill + one step per token), a
    time no server decoding the streams together can beat.
    """
    step = median([p["step_ms"] for p in passes]) / 1000
    prefill = median([p["prefill_ms"] for p in passes]) / 1000
    return streams / step, streams * tokens / (prefill + tokens * step)


def second_turn(
    target: MlxServerTarget | ServiceTarget, max_tokens: int
) -> tuple[Sample, Sample, int]:
    """(cold, warm, first-turn output tokens) for one conversation."""
    nonce = uuid.uuid4().hex[:8]
    system = f"Session {nonce}. {HANDBOOK}"
    first_turn = chat(FIRST_QUESTION, system)
    if isinstance(target, ServiceTarget):
        first, response_id, answer = target.stream_with_id(first_turn, max_tokens)
        warm = target.stream([{"role": "user", "content": SECOND_QUESTION}], 16, response_id)
    else:
        body = {"messages": first_turn, "max_tokens": max_tokens, "temperature": 0.0}
        reply = target.client.post("/v1/chat/completions", json=body).json()
        answer = reply["choices"][0]["message"]["content"]
        first = Sample(0, None, None, 0, reply["usage"]["completion_tokens"])
        conversation = [
            *first_turn,
            {"role": "assistant", "content": answer},
            {"role": "user", "content": SECOND_QUESTION},
        ]
        warm = target.stream(conversation, 16)
    # The same conversation under a system prompt never seen: nothing to reuse.
    cold_system = f"Session {uuid.uuid4().hex[:8]}. {HANDBOOK}"
    cold = target.stream(
        [
            *chat(FIRST_QUESTION, cold_system),
            {"role": "assistant", "content": answer},
            {"role": "user", "content": SECOND_QUESTION},
        ],
        16,
    )
    return cold, warm, first.tokens


def model_and_blas(args: argparse.Namespace) -> tuple[Path, Any]:
    """The demo model (converted on first use into `--model-dir`) and the BLAS the service's
    probe chooses, probed once (or read from the cache the service reads too) with the
    service's settings (`--blas-threads`, `--blas-coretype`, `--blas-candidates`)."""
    sys.path.insert(0, str(REPO))
    from jupyter_lmsp.engine.blas import choose_blas
    from jupyter_lmsp.models.demo import ensure_demo_model

    model = ensure_demo_model(args.model_dir)
    if args.blas_threads > 0:
        # Inherited by every child process, and by the service's worker through the jupyter
        # server's environment.
        os.environ["OPENBLAS_NUM_THREADS"] = str(args.blas_threads)
    blas = choose_blas(
        threads=args.blas_threads, coretype=args.blas_coretype, only=args.blas_candidates
    )
    return model, blas


def service_blas_traits(args: argparse.Namespace, blas: Any) -> dict[str, Any]:
    """The service's settings that hold it to the same library as `blas` (it still probes it:
    a rejected one is not used)."""
    from jupyter_lmsp.engine.blas import REFERENCE

    traits: dict[str, Any] = {"blas_coretype": args.blas_coretype}
    if blas.name != REFERENCE:
        traits["blas_candidates"] = blas.name
    return traits


def machine_meta(blas: Any) -> dict[str, Any]:
    """What a run's results record of the BLAS choice, the machine and its load at the start."""
    return {
        "blas_choice": blas.report(),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": package_versions(),
        "load_before": os.getloadavg(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def run(args: argparse.Namespace) -> Results:
    model, blas = model_and_blas(args)  # puts this checkout first on sys.path
    from jupyter_lmsp.engine.blas.candidates import read_cpu

    blas_env = blas.worker_environment()
    log(f"model {model}; BLAS for mlx-lm children: {blas.name} ({blas.reason})")
    blas_traits = service_blas_traits(args, blas)
    cpu = read_cpu()
    results = Results()
    results.meta = {
        "model": model.name,
        "max_tokens": args.tokens,
        "rounds": args.rounds,
        "concurrency": args.concurrency,
        "max_batch_size": args.max_batch_size,
        "mlx_server_blas": args.mlx_server_blas,
        "blas_threads": os.environ.get("OPENBLAS_NUM_THREADS", "OpenBLAS default"),
        # Every flag of this run, so the results say how they were made.
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "openblas_coretype": blas.coretype or os.environ.get("OPENBLAS_CORETYPE") or "",
        "cpu": {
            "model": cpu.model,
            "avx512": cpu.avx512,
            "simd_flags": sorted(f for f in cpu.flags if f.startswith(("avx", "fma", "sse4"))),
        },
        **machine_meta(blas),
    }
    tmp = Path(tempfile.mkdtemp(prefix="lmsp-bench-"))
    targets: list[Any] = []
    try:
        bare = BareTarget(model, blas_env)
        targets.append(bare)
        # `stock`: mlx_lm.server as `pip install mlx-lm` runs it on Linux, with the BLAS that
        # mlx[cpu] bundles; `openblas` (the default): with the OpenBLAS the service's worker
        # uses, so the comparison is of the serving, not of the BLAS.
        stock = args.mlx_server_blas == "stock"
        mlx = MlxServerTarget(model, None if stock else blas_env, tmp)
        targets.append(mlx)
        service = ServiceTarget(model, tmp / "service", args.max_batch_size, blas_traits)
        targets.append(service)
        log("warming up")
        for target in targets:
            target.stream(chat("Say hello."), 8)
        description = service.service()
        worker, service_blas = description.get("worker", {}), description.get("blas") or {}
        results.meta["service_blas"] = service_blas
        chosen = f"{blas.name} ({blas.config or 'mlx bundled'}, {bare.blas} in the child)"
        results.meta["blas"] = {
            bare.name: chosen,
            mlx.name: "mlx[cpu]'s bundled BLAS (stock)" if stock else chosen,
            service.name: f"{service_blas.get('name')} ({service_blas.get('config')}, "
            f"{worker.get('blas', 'unknown')} in the worker)",
        }
        if service_blas.get("name") != blas.name:
            log(f"warning: the service chose {service_blas.get('name')}, the script {blas.name}")
        log(f"BLAS: {results.meta['blas']}")

        tokens = args.tokens
        for target in targets:
            results.single[target.name] = []
        for round_ in range(args.rounds):
            for target in targets:
                sample = target.stream(story(round_, uuid.uuid4().hex[:6]), tokens)
                results.single[target.name].append(as_dict(sample))
                log(
                    f"single r{round_} {target.name}: {sample.tokens} tok, ttft "
                    f"{sample.ttft:.2f}s, decode {sample.decode_tps:.1f} tok/s"
                )

        for target in (mlx, service):
            results.concurrent[target.name] = {n: [] for n in args.concurrency}
        for n in args.concurrency:
            if n == 1:
                # One stream is the single-stream measurement above: reuse it.
                for target in (mlx, service):
                    results.concurrent[target.name][1] = [
                        [sample] for sample in results.single[target.name]
                    ]
                continue
            results.ceiling[n] = []
            for round_ in range(args.rounds):
                for target in (mlx, service):
                    samples = concurrently(target.stream, n, tokens)
                    results.concurrent[target.name][n].append([as_dict(s) for s in samples])
                    log(
                        f"concurrent n={n} r{round_} {target.name}: "
                        f"{sum(s.tokens for s in samples)} tok, {aggregate_tps(samples):.1f} tok/s"
                    )
                if not stock:  # the ceiling of the BLAS both servers use
                    measured = forward_pass(model, blas_env, n)
                    results.ceiling[n].append(measured)
                    log(
                        f"no server n={n} r{round_}: step {measured['step_ms']:.1f} ms, "
                        f"prefill {measured['prefill_ms']:.0f} ms"
                    )

        for target in (mlx, service):
            results.turns[target.name] = {"cold": [], "warm": []}
        for round_ in range(args.rounds):
            for target in (mlx, service):
                cold, warm, first_tokens = second_turn(target, tokens)
                results.turns[target.name]["cold"].append(as_dict(cold))
                results.turns[target.name]["warm"].append(as_dict(warm))
                log(
                    f"second turn r{round_} {target.name}: cold {cold.ttft:.2f}s, warm "
                    f"{warm.ttft:.2f}s (cached {warm.cached_tokens}; turn 1: {first_tokens} tok)"
                )
    finally:
        for target in reversed(targets):
            target.close()
        if args.keep_logs:
            log(f"logs kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    results.meta["load_after"] = os.getloadavg()
    results.meta["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    return results


def package_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("mlx", "mlx-lm", "jupyter-lmsp", "ngsolve-openblas", "cmeel-openblas"):
        with contextlib.suppress(PackageNotFoundError):
            found[name] = version(name)
    return found


# --- report -----------------------------------------------------------------------------------


def summarize(results: Results) -> dict[str, Any]:
    single = {
        name: {
            "ttft": median([s["ttft"] for s in samples]),
            "decode_tps": median([s["decode_tps"] for s in samples]),
            "e2e_tps": median([s["e2e_tps"] for s in samples]),
            "tokens": median([s["tokens"] for s in samples]),
        }
        for name, samples in results.single.items()
    }
    concurrent = {
        name: {
            n: median([aggregate_tps([Sample(**_fields(s)) for s in run]) for run in runs])
            for n, runs in levels.items()
        }
        for name, levels in results.concurrent.items()
    }
    turns = {
        name: {kind: median([s["ttft"] for s in samples]) for kind, samples in kinds.items()}
        for name, kinds in results.turns.items()
    }
    cached = {
        name: median([s["cached_tokens"] or 0 for s in kinds["warm"]])
        for name, kinds in results.turns.items()
    }
    tokens = results.meta["max_tokens"]
    ceiling = {
        n: dict(zip(("decode", "bound"), ceilings(passes, n, tokens), strict=True))
        for n, passes in results.ceiling.items()
        if passes
    }
    # The service against mlx_lm.server round by round (the rounds are interleaved, so each
    # round's pair met the same load): the spread a ratio's median hides.
    mlx, service = MlxServerTarget.name, ServiceTarget.name
    ratios: dict[str, list[float]] = {}
    if mlx in results.single and service in results.single:
        for key in ("decode_tps", "e2e_tps"):
            ratios[f"single {key}"] = [
                b[key] / a[key]
                for a, b in zip(results.single[mlx], results.single[service], strict=False)
                if a[key]
            ]
    for n, runs in results.concurrent.get(service, {}).items():
        theirs = results.concurrent.get(mlx, {}).get(n, [])
        ratios[f"{n} streams"] = [
            aggregate_tps([Sample(**_fields(s)) for s in b])
            / aggregate_tps([Sample(**_fields(s)) for s in a])
            for a, b in zip(theirs, runs, strict=False)
        ]
    return {
        "single": single,
        "concurrent": concurrent,
        "turns": turns,
        "cached": cached,
        "ceiling": ceiling,
        "ratios": ratios,
    }


def spread(values: list[float]) -> str:
    """median (min–max) of per-round ratios."""
    if not values:
        return "n/a"
    return f"{median(values):.2f}× ({min(values):.2f}–{max(values):.2f})"


def _fields(sample: dict[str, Any]) -> dict[str, Any]:
    return {k: sample[k] for k in ("sent", "first", "last", "done", "tokens", "cached_tokens")}


# Issue 11's figures for a user of a CPU without AVX-512 before the BLAS choice (AMD EPYC, AVX2,
# everything on mlx's reference BLAS): single-stream decode 4.1 tok/s, 8 streams 2.8 tok/s in
# aggregate. The targets are 2.5x and 10x those, on such a CPU (or with AVX-512 masked).
ISSUE_11_BASELINE = {"single": 4.1, "8 streams": 2.8}
ISSUE_11_FACTOR = {"single": 2.5, "8 streams": 10.0}


def _issue_11(summary: dict[str, Any], meta: dict[str, Any]) -> list[str]:
    service = ServiceTarget.name
    measured = {
        "single": summary["single"][service]["decode_tps"],
        "8 streams": summary["concurrent"][service].get(8),
    }
    lines = [
        "Issue 11 (a CPU without AVX-512; this run: AVX-512 "
        + (
            f"masked, OPENBLAS_CORETYPE={meta['openblas_coretype']}"
            if meta["openblas_coretype"]
            else ("present" if meta["cpu"]["avx512"] else "absent")
        )
        + "):",
        "",
        "| | before (reference BLAS) | target | LMSP service | × before |",
        "|---|---:|---:|---:|---:|",
    ]
    for what, before in ISSUE_11_BASELINE.items():
        value = measured[what]
        target = before * ISSUE_11_FACTOR[what]
        if value is None:
            lines.append(f"| {what} | {before} | ≥ {target:.1f} | not run | |")
        else:
            lines.append(
                f"| {what} | {before} | ≥ {target:.1f} | {value:.1f} | {value / before:.1f}× |"
            )
    return [*lines, ""]


def cli_flags(args: dict[str, Any]) -> list[str]:
    """The command-line flags that give a run's `args` (recorded in its results), defaults
    left out."""
    flags = []
    for name, value in args.items():
        if name == "bare_child" or value in (None, False, [], ""):
            continue
        flag = "--" + name.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif isinstance(value, list):
            flags.append(f"{flag} {' '.join(map(str, value))}")
        else:
            flags.append(f"{flag} {value}")
    return flags


def render(results: Results, summary: dict[str, Any]) -> str:
    meta = results.meta
    mlx, service = MlxServerTarget.name, ServiceTarget.name
    lines = [
        "# Engine benchmark",
        "",
        f"`benchmarks/bench_engine.py`, {meta['started']} – {meta['finished']}. Model "
        f"`{meta['model']}` (float32), greedy, {meta['max_tokens']} output tokens per stream, "
        f"median of {meta['rounds']} interleaved rounds. Machine: {meta['cpus']} CPUs, "
        f"{meta['platform']}, load average {meta['load_before'][0]:.1f} before / "
        f"{meta['load_after'][0]:.1f} after. Versions: "
        + ", ".join(f"{k} {v}" for k, v in meta["versions"].items())
        + ". BLAS: "
        + ", ".join(f"{k}: {v}" for k, v in meta["blas"].items())
        + f", OPENBLAS_NUM_THREADS={meta['blas_threads']}, OPENBLAS_CORETYPE="
        f"{meta['openblas_coretype'] or '(unset)'} for the OpenBLAS ones. CPU: "
        f"{meta['cpu']['model']}, AVX-512 {'yes' if meta['cpu']['avx512'] else 'no'}"
        f" ({' '.join(meta['cpu']['simd_flags'])}). Service: "
        f"`--LMSPExtension.max_batch_size={meta['max_batch_size']}`, default prompt cache. "
        "Flags: `" + " ".join(cli_flags(meta["args"])) + "`.",
        "",
        "## Single stream",
        "",
        "| | TTFT (s) | decode tok/s | end-to-end tok/s | tokens |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, row in summary["single"].items():
        lines.append(
            f"| {name} | {row['ttft']:.2f} | {row['decode_tps']:.1f} | {row['e2e_tps']:.1f} "
            f"| {row['tokens']:.0f} |"
        )
    s, m = summary["single"][service], summary["single"][mlx]
    lines += [
        "",
        f"Service / mlx_lm.server: decode {s['decode_tps'] / m['decode_tps']:.2f}×, "
        f"end-to-end {s['e2e_tps'] / m['e2e_tps']:.2f}× (target ≥ 1.0×). Round by round, "
        f"median (min–max): decode {spread(summary['ratios'].get('single decode_tps', []))}, "
        f"end-to-end {spread(summary['ratios'].get('single e2e_tps', []))}.",
        "",
        *_issue_11(summary, meta),
        "## Aggregate throughput, concurrent streams (tok/s)",
        "",
        "| streams | mlx_lm.server | LMSP service | service / mlx_lm.server "
        "| round by round | decode ceiling (no server) | with prefill | bound / mlx_lm.server |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    ceiling = summary.get("ceiling", {})
    for n in meta["concurrency"]:
        a, b = summary["concurrent"][mlx][n], summary["concurrent"][service][n]
        top = ceiling.get(n)
        bound = (
            f"{top['decode']:.1f} | {top['bound']:.1f} | {top['bound'] / a:.2f}×" if top else "| |"
        )
        by_round = spread(summary["ratios"].get(f"{n} streams", []))
        lines.append(f"| {n} | {a:.1f} | {b:.1f} | {b / a:.2f}× | {by_round} | {bound} |")
    lines += [
        "",
        "Aggregate = all tokens / (last stream done − first request sent), each stream its own "
        "prompt; 1 stream is the single-stream run above. Target at 8 streams ≥ 1.2×.",
        "",
        "No server: `bench_forward.py`'s measurement of the demo model alone, in a child process "
        "with the same BLAS, right after each round's streams (median of the rounds). Decode "
        "ceiling = streams / one forward step of that many sequences (greedy argmax, nothing "
        "else). With prefill = all tokens / (the prefill of that many prompts of ~14 new tokens "
        "after a cached prefix + one forward step per output token): no server decoding the "
        "streams together on these kernels can be faster, so *bound / mlx_lm.server* is the "
        "largest ratio over mlx_lm.server any such server could show in this run.",
        "",
        "## Second chat turn, time to first token (s)",
        "",
        "| | cold | warm | warm / cold | cached prompt tokens (warm) |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, row in summary["turns"].items():
        cached = summary["cached"].get(name)
        lines.append(
            f"| {name} | {row['cold']:.2f} | {row['warm']:.2f} | "
            f"{row['warm'] / row['cold']:.2f} | {cached:.0f} |"
        )
    lines += [
        "",
        "A ~600-token conversation (long system prompt, first question and its answer, second "
        "question). Warm: right after the first turn (service: `previous_response_id`; "
        "mlx_lm.server: the whole conversation again). Cold: the same conversation under a "
        "never-seen system prompt. Target: warm ≤ 0.3× cold.",
        "",
    ]
    return "\n".join(lines)


def plot(results: Results, summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    names = list(summary["single"])
    colors = {
        names[0]: "#9e9e9e",
        MlxServerTarget.name: "#f28e2b",
        ServiceTarget.name: "#4e79a7",
    }
    ax = axes[0]
    values = [summary["single"][n]["decode_tps"] for n in names]
    ax.bar(range(len(names)), values, color=[colors[n] for n in names])
    ax.set_xticks(range(len(names)), [n.replace(" ", "\n", 1) for n in names], fontsize=8)
    ax.set_ylabel("tokens/s")
    ax.set_title("Single stream decode rate")

    ax = axes[1]
    levels = results.meta["concurrency"]
    width = 0.38
    for i, name in enumerate((MlxServerTarget.name, ServiceTarget.name)):
        xs = [x + (i - 0.5) * width for x in range(len(levels))]
        ax.bar(
            xs,
            [summary["concurrent"][name][n] for n in levels],
            width,
            label=name,
            color=colors[name],
        )
    tops = [(x, summary["ceiling"].get(n)) for x, n in enumerate(levels)]
    tops = [(x, top["bound"]) for x, top in tops if top]
    if tops:
        ax.scatter(
            [x for x, _ in tops],
            [top for _, top in tops],
            marker="_",
            s=900,
            color="black",
            label="bound: no server, prefill + decode",
        )
    ax.set_xticks(range(len(levels)), [str(n) for n in levels])
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("aggregate tokens/s")
    ax.set_title("Aggregate throughput")
    ax.legend()

    ax = axes[2]
    for i, name in enumerate((MlxServerTarget.name, ServiceTarget.name)):
        row = summary["turns"][name]
        ax.bar(
            [i - width / 2, i + width / 2],
            [row["cold"], row["warm"]],
            width,
            color=[colors[name], colors[name]],
            alpha=1.0,
        )
        ax.text(
            i + width / 2,
            row["warm"],
            f"{row['warm'] / row['cold']:.2f}×",
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_xticks(
        [0, 1],
        [f"{MlxServerTarget.name}\ncold | warm", f"{ServiceTarget.name}\ncold | warm"],
        fontsize=8,
    )
    ax.set_ylabel("seconds")
    ax.set_title("Second turn: time to first token")
    fig.suptitle(
        f"{results.meta['model']}, {results.meta['cpus']} CPUs, "
        f"{results.meta['blas_choice']['name']}, greedy"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=DEFAULT_MODEL_DIR,
        help=f"where the demo model is converted (default {DEFAULT_MODEL_DIR})",
    )
    parser.add_argument("--tokens", type=int, default=64, help="output tokens per stream")
    parser.add_argument("--rounds", type=int, default=3, help="repetitions (median is reported)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument(
        "--max-batch-size", type=int, default=8, help="the service's LMSPExtension.max_batch_size"
    )
    parser.add_argument(
        "--blas-threads",
        type=int,
        default=1,
        help="OPENBLAS_NUM_THREADS for all three (0: OpenBLAS's default, one per CPU)",
    )
    parser.add_argument(
        "--mlx-server-blas",
        choices=["openblas", "stock"],
        default="openblas",
        help="mlx_lm.server with the service's OpenBLAS (default) or as pip installs it",
    )
    parser.add_argument(
        "--blas-coretype",
        default="",
        help="OPENBLAS_CORETYPE for all three (e.g. Haswell: AVX-512 masked on a DYNAMIC_ARCH "
        "OpenBLAS, fixed AVX-512 builds skipped); default: the environment's",
    )
    parser.add_argument(
        "--blas-candidates",
        nargs="+",
        default=[],
        help="choose only among these BLAS candidates (names as `python -m "
        "jupyter_lmsp.engine.blas` lists them; the reference is always measured)",
    )
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--keep-logs", action="store_true", help="keep the servers' logs")
    parser.add_argument("--bare-child", metavar="MODEL", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.bare_child:
        bare_child(args.bare_child)
        return 0
    started = time.monotonic()
    results = run(args)
    summary = summarize(results)
    args.out.mkdir(parents=True, exist_ok=True)
    report = render(results, summary)
    (args.out / "engine.md").write_text(report)
    (args.out / "engine.json").write_text(
        json.dumps(
            {
                "meta": results.meta,
                "single": results.single,
                "concurrent": results.concurrent,
                "turns": results.turns,
                "ceiling": results.ceiling,
                "summary": summary,
            },
            indent=1,
        )
    )
    written = "md,json"
    try:
        plot(results, summary, args.out / "engine.png")
        written += ",png"
    except ImportError as e:  # matplotlib is not among the project's dependencies
        log(f"no plot: {e} (`pip install matplotlib` for engine.png)")
    print(report)
    log(f"done in {time.monotonic() - started:.0f} s; wrote {args.out}/engine.{{{written}}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
