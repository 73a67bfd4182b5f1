"""The pipeline's parts that issue 42 changed, each timed in CPU time against what it replaced,
in one process, alternating (A B B A ...), so the load of a shared machine meets both alike.

    .venv/bin/python benchmarks/bench_pipeline_parts.py [--rounds 6]

- commits: 8 tasks' claim (`rules.claim_to_run`), start (`rules.start_running`) and end
  (`rules.finish`) as 24 transactions one after the other, against the same 24 rules as
  savepoints of one `Database.grouped` transaction (what the runner's database thread now does
  with the jobs waiting together), CPU per task;
- chunks: a chat stream's text-delta chunk as `chunk_object` + `json.dumps` against
  `services.chat.ContentChunks`, CPU per chunk;
- metrics: a step of 8 rows counted row by row (`RunnerClock.tokens`) against once per step
  (`RunnerClock.step`), CPU per step;
- reader: 8-row step messages read from a pipe with `Connection.recv` against
  `engine.frames.FrameReader`, CPU per message (the sender writes one message at a time, as a
  worker does, pausing after each so the reader waits as it does for a decode step).

Prints each figure's median (min-max) over rounds, and writes nothing.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import pickle
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_store_rules import _task  # noqa: E402

from jupyter_lmsp.engine.frames import FrameReader  # noqa: E402
from jupyter_lmsp.engine.messages import JobTokens, StepTokens  # noqa: E402
from jupyter_lmsp.protocol.chat import ChunkChoice, ChunkDelta, chunk_object  # noqa: E402
from jupyter_lmsp.protocol.objects import usage_object  # noqa: E402
from jupyter_lmsp.services import metrics  # noqa: E402
from jupyter_lmsp.services.chat import ContentChunks  # noqa: E402
from jupyter_lmsp.services.runner_clock import RunnerClock  # noqa: E402
from jupyter_lmsp.store import rules  # noqa: E402
from jupyter_lmsp.store.database import Database, sqlite_url  # noqa: E402


def cpu(fn: Callable[[], None]) -> float:
    began = time.thread_time()
    fn()
    return time.thread_time() - began


def commits(db: Database, grouped: bool) -> float:
    """CPU seconds per task of a claim, a start and an end, for 8 tasks."""
    tasks = [_task() for _ in range(8)]
    for task, response in tasks:
        rules.create_task(db, task, response)

    def lifecycle() -> None:
        for task, _ in tasks:
            rules.claim_to_run(db, task.id, None)
        for task, _ in tasks:
            rules.start_running(db, task.id, 3)
        for task, _ in tasks:
            rules.finish(db, task.id, rules.Outcome("completed", usage=usage_object(3, 8)))

    def run() -> None:
        if grouped:
            with db.grouped():
                lifecycle()
        else:
            lifecycle()

    return cpu(run) / len(tasks)


def chunks(fast: bool, n: int = 2000) -> float:
    head = {"id": "resp_1", "task_id": "task_1", "created_at": 1765000000, "model": "tiny"}
    content = ContentChunks(head, True)

    def run() -> None:
        for i in range(n):
            if fast:
                content.chunk(0, f"tok{i} ")
            else:
                json.dumps(
                    chunk_object(
                        head,
                        choices=[
                            ChunkChoice(
                                index=0, delta=ChunkDelta(content=f"tok{i} "), finish_reason=None
                            )
                        ],
                        include_usage=True,
                    ),
                    separators=(",", ":"),
                )

    return cpu(run) / n


def step_metrics(per_step: bool, n: int = 2000) -> float:
    clock = RunnerClock()
    ids = [f"task_{i}" for i in range(8)]
    for task_id in ids:
        clock.submitted(task_id)
        clock.handed(task_id, "tiny", 0)

    def run() -> None:
        for _ in range(n):
            if per_step:
                clock.step([(t, 1) for t in ids], [8])
            else:
                for k, t in enumerate(ids):
                    clock.step([(t, 1)], [8] if k == 0 else [])  # as a lone row was

    return cpu(run) / n


def reader(frames: bool, n: int = 1500) -> float:
    ours, theirs = multiprocessing.Pipe(duplex=True)
    step = StepTokens([JobTokens(f"task_{i}", [1234], "tok ") for i in range(8)])
    data = pickle.dumps(step, pickle.HIGHEST_PROTOCOL)

    def send() -> None:
        for _ in range(n):
            theirs.send_bytes(data)
            time.sleep(0.0002)
        theirs.close()

    sender = threading.Thread(target=send)
    sender.start()
    began = time.thread_time()
    got = 0
    try:
        if frames:
            reading = FrameReader(ours.fileno())
            while True:
                got += len(reading.read())
        else:
            while True:
                ours.recv()
                got += 1
    except EOFError:
        pass
    spent = time.thread_time() - began
    sender.join()
    ours.close()
    assert got == n
    return spent / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    metrics.set_enabled(True)
    folder = tempfile.mkdtemp(prefix="lmsp-parts-")
    db = Database(sqlite_url(Path(folder) / "parts.sqlite"))
    parts: dict[str, Callable[[bool], float]] = {
        "commits: claim+start+end, CPU per task (us)": lambda new: commits(db, new),
        "chunks: a text delta's chunk, CPU per chunk (us)": chunks,
        "metrics: a step of 8 rows, CPU per step (us)": step_metrics,
        "reader: an 8-row step message, CPU per message (us)": reader,
    }
    for name, part in parts.items():
        part(False), part(True)  # warm-up
        old: list[float] = []
        new: list[float] = []
        for r in range(args.rounds):
            for is_new in (False, True) if r % 2 == 0 else (True, False):
                (new if is_new else old).append(part(is_new) * 1e6)
        ratios = [b / a for a, b in zip(old, new, strict=True)]
        print(
            f"{name}: before {statistics.median(old):.1f} ({min(old):.1f}-{max(old):.1f}), "
            f"after {statistics.median(new):.1f} ({min(new):.1f}-{max(new):.1f}), "
            f"after/before {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})",
            flush=True,
        )
    db.dispose()


if __name__ == "__main__":
    main()
