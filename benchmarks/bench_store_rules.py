"""CPU per call of the store's hottest rules on SQLite, for comparing two trees (issue 41).

    .venv/bin/python benchmarks/bench_store_rules.py [--calls 300] [--dir /dev/shm]
    PYTHONPATH=/path/to/other/checkout .venv/bin/python benchmarks/bench_store_rules.py

Prints one JSON line, CPU (`time.process_time`) and wall time per call, measured with the
garbage collector paused:
- `create`: `rules.create_task` of a background response (task, response, first event);
- `outputs`: `rules.append_outputs` of one plain text delta to each of 8 running tasks;
- `load_start_finish`: `append_events` (queued → loading), `start_running` and `finish` of one
  task, together.

Run it alternately in the two trees (a new database each run), several rounds, and compare
the medians and their spread: on a shared machine one run is noise. `--dir /dev/shm` takes
the disk's fsync out of the wall times (the CPU times still count the syscalls).
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from jupyter_lmsp.protocol import events as ev
from jupyter_lmsp.protocol.ids import new_id
from jupyter_lmsp.protocol.objects import response_object, usage_object
from jupyter_lmsp.store import rules
from jupyter_lmsp.store.database import Database, sqlite_url
from jupyter_lmsp.store.tables import Response, Task


def _task() -> tuple[Task, Response]:
    now = time.time()
    task_id = new_id("task")
    response = Response(
        id=new_id("resp"),
        task_id=task_id,
        owner="owner",
        model="m",
        request=json.dumps({"model": "m", "input": "hi", "background": True}),
        created_at=now,
    )
    task = Task(
        id=task_id,
        kind="response",
        state="queued",
        on_restart="fail",
        owner="owner",
        model="m",
        response_id=response.id,
        created_at=now,
        updated_at=now,
    )
    return task, response


def _loading(task: Task, response: Response | None) -> list[dict[str, Any]]:
    assert response is not None
    return [ev.lifecycle(ev.LOADING, response_object(response, task))]


def _timed(fn: Any, n: int) -> tuple[float, float]:
    cpu, wall = time.process_time(), time.perf_counter()
    fn()
    return (time.process_time() - cpu) / n * 1e6, (time.perf_counter() - wall) / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--dir", default=None, help="where the database goes (a temporary dir)")
    args = parser.parse_args()
    n = args.calls
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        db = Database(sqlite_url(Path(folder) / "bench.sqlite"))
        created = [_task() for _ in range(n)]
        running = [_task() for _ in range(8)]
        for task, response in running:
            rules.create_task(db, task, response)
            rules.append_events(db, task.id, _loading, to_state="loading", only_from=["queued"])
            rules.start_running(db, task.id, input_tokens=3)
        ids = [task.id for task, _ in running]
        lives = created[: max(1, n // 3)]

        def create() -> None:
            for task, response in created:
                rules.create_task(db, task, response)

        def outputs() -> None:
            for i in range(n):
                rules.append_outputs(db, {task_id: ([i], " tok") for task_id in ids})

        def lifecycle() -> None:
            for task, _ in lives:
                rules.append_events(db, task.id, _loading, to_state="loading")
                rules.start_running(db, task.id, input_tokens=3)
                rules.finish(db, task.id, rules.Outcome("completed", usage=usage_object(3, 0)))

        gc.disable()
        try:
            result = {}
            for name, fn, calls in (
                ("create", create, n),
                ("outputs", outputs, n),
                ("load_start_finish", lifecycle, len(lives)),
            ):
                cpu, wall = _timed(fn, calls)
                result[f"{name}_cpu_us"], result[f"{name}_wall_us"] = round(cpu, 1), round(wall, 1)
        finally:
            gc.enable()
            db.dispose()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
