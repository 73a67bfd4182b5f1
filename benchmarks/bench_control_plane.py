"""Control-plane benchmark (issue 3): one command, measured side by side in one run.

    .venv/bin/python benchmarks/bench_control_plane.py [--quick]

1. Background create → 202: latency p50/p99 of sequential POSTs, and the rate with 8 concurrent
   clients, against a real `jupyter server` with durable commits (synchronous=FULL). The
   worker holds one slow task, so the others stay queued: the create path is what is timed.
2. Event append rate: `rules.append_output` (one delta event + snapshot per transaction) against
   raw `sqlite3` doing the same transaction on the same kind of file, side by side.
3. Start-up recovery time for 10,000 unfinished tasks (`rules.recover_at_startup`).
4. Delivery lag p50/p99 to 200 concurrent SSE readers of one task (receive time − commit time).

Results go to benchmarks/results/control_plane.md (and .json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from serverproc import ServerProcess  # noqa: E402

from jupyter_lmsp.models.testmodel import make_test_model  # noqa: E402
from jupyter_lmsp.protocol.states import RestartPolicy  # noqa: E402
from jupyter_lmsp.store import rules  # noqa: E402
from jupyter_lmsp.store.database import Database, sqlite_url  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def prepare_data_dir(base: Path) -> Path:
    (base / "models").mkdir(parents=True)
    make_test_model(base / "models" / "tiny")
    return base


# 1 -------------------------------------------------------------------------------------------
def bench_creates(base: Path, n_seq: int, n_conc: int) -> dict:
    body = {"input": "hi", "background": True, "max_output_tokens": 1, "temperature": 0}
    # One generation slot and a slow worker: the first task occupies it and the rest stay
    # queued, so this measures the create path (parse, commit, 202) rather than how fast the
    # worker then runs thousands of tasks on the same two CPUs.
    slow = {"max_batch_size": 1, "engine_token_delay": 60}
    with ServerProcess(prepare_data_dir(base / "creates"), **slow) as server, server.client() as c:
        for _ in range(20):  # warm up connections and code paths
            c.post("/responses", json=body)
        latencies = []
        for _ in range(n_seq):
            t = time.perf_counter()
            r = c.post("/responses", json=body)
            latencies.append((time.perf_counter() - t) * 1000)
            assert r.status_code == 202, r.text
        per_thread = n_conc // 8
        barrier = threading.Barrier(8)

        def worker() -> None:
            with server.client() as cc:
                barrier.wait()
                for _ in range(per_thread):
                    assert cc.post("/responses", json=body).status_code == 202

        threads = [threading.Thread(target=worker) for _ in range(8)]
        start = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        elapsed = time.perf_counter() - start
    return {
        "p50_ms": statistics.median(latencies),
        "p99_ms": pct(latencies, 0.99),
        "sequential_rate": n_seq / (sum(latencies) / 1000),
        "concurrent_rate": per_thread * 8 / elapsed,
    }


# 2 -------------------------------------------------------------------------------------------
def running_task(db: Database) -> str:
    sys.path.insert(0, str(ROOT / "tests"))
    from storehelpers import make_task

    return make_task(db, "running", on_restart="resume")


def bench_appends(base: Path, n: int) -> dict:
    db = Database(sqlite_url(base / "appends.sqlite"))
    task_id = running_task(db)
    for _ in range(50):
        rules.append_output(db, task_id, [1], "x")
    t = time.perf_counter()
    for i in range(n):
        rules.append_output(db, task_id, [i % 400], " tok")
    store_rate = n / (time.perf_counter() - t)

    raw_path = base / "raw.sqlite"
    conn = sqlite3.connect(raw_path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute(
        "CREATE TABLE tasks (id TEXT PRIMARY KEY, state TEXT, snapshot TEXT, next_sequence INT, updated_at REAL)"
    )
    conn.execute(
        "CREATE TABLE task_events (id INTEGER PRIMARY KEY, task_id TEXT, sequence_number INT, type TEXT, data TEXT, created_at REAL, UNIQUE(task_id, sequence_number))"
    )
    conn.execute(
        "INSERT INTO tasks VALUES ('t', 'running', ?, 0, 0)",
        (
            json.dumps(
                {"token_ids": [], "text": "", "open": True, "item_id": "msg_x", "output_index": 0}
            ),
        ),
    )

    def raw_append(token: int) -> None:
        conn.execute("BEGIN IMMEDIATE")
        _state, snap, seq = conn.execute(
            "SELECT state, snapshot, next_sequence FROM tasks WHERE id='t'"
        ).fetchone()
        snapshot = json.loads(snap)
        snapshot["token_ids"].append(token)
        snapshot["text"] += " tok"
        event = {
            "type": "response.output_text.delta",
            "item_id": "msg_x",
            "output_index": 0,
            "content_index": 0,
            "delta": " tok",
            "logprobs": [],
            "sequence_number": seq,
        }
        conn.execute(
            "INSERT INTO task_events (task_id, sequence_number, type, data, created_at) VALUES ('t', ?, ?, ?, ?)",
            (seq, event["type"], json.dumps(event), time.time()),
        )
        conn.execute(
            "UPDATE tasks SET snapshot=?, next_sequence=?, updated_at=? WHERE id='t'",
            (json.dumps(snapshot), seq + 1, time.time()),
        )
        conn.execute("COMMIT")

    for i in range(50):
        raw_append(i)
    t = time.perf_counter()
    for i in range(n):
        raw_append(i % 400)
    raw_rate = n / (time.perf_counter() - t)
    conn.close()
    db.dispose()
    return {"store_rate": store_rate, "raw_rate": raw_rate, "ratio": store_rate / raw_rate}


# 3 -------------------------------------------------------------------------------------------
def bench_recovery(base: Path, n: int) -> dict:
    from storehelpers import make_tasks

    db = Database(sqlite_url(base / "recovery.sqlite"))
    states = ["queued", "loading", "running", "cancelling"]
    policies = [p.value for p in RestartPolicy]
    per = n // (len(states) * len(policies))
    for state in states:
        for policy in policies:
            make_tasks(db, per, state, on_restart=policy)
    t = time.perf_counter()
    report = rules.recover_at_startup(db)
    elapsed = time.perf_counter() - t
    assert report.examined == per * len(states) * len(policies)
    db.dispose()
    return {"tasks": report.examined, "seconds": elapsed, "transitions": report.transitions}


# 4 -------------------------------------------------------------------------------------------
async def _reader(
    client: httpx.AsyncClient,
    path: str,
    received: list[tuple[int, float]],
    ready: asyncio.Event,
    counter: list[int],
    total: int,
) -> None:
    # The reader reads only the `id:` lines: 200 readers in one client process must stay
    # cheaper than the server they measure.
    async with client.stream("GET", path, params={"stream": "true"}) as r:
        counter[0] += 1
        if counter[0] == total:
            ready.set()
        buffer = b""
        async for chunk in r.aiter_raw():
            now = time.time()
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                if line.startswith(b"id: "):
                    received.append((int(line[4:]), now))


def bench_sse(base: Path, readers: int, tokens: int) -> dict:
    data = prepare_data_dir(base / "sse")
    with ServerProcess(data, engine_token_delay=0.05, snapshot_interval=0.0) as server:

        async def run() -> list[list[tuple[int, float]]]:
            limits = httpx.Limits(max_connections=readers + 10)
            async with httpx.AsyncClient(
                base_url=server.api,
                headers={"Authorization": "token lmsp-test-token"},
                timeout=120,
                limits=limits,
            ) as client:
                r = await client.post(
                    "/responses",
                    json={
                        "input": "go",
                        "background": True,
                        "max_output_tokens": tokens,
                        "temperature": 0,
                    },
                )
                task_id = r.json()["task_id"]
                got: list[list[tuple[int, float]]] = [[] for _ in range(readers)]
                ready, counter = asyncio.Event(), [0]
                await asyncio.gather(
                    *(
                        _reader(client, f"/tasks/{task_id}/events", got[i], ready, counter, readers)
                        for i in range(readers)
                    )
                )
                return got, task_id

        got, task_id = asyncio.run(run())
    conn = sqlite3.connect(data / "lmsp.sqlite")
    committed = dict(
        conn.execute(
            "SELECT sequence_number, created_at FROM task_events WHERE task_id=?", (task_id,)
        ).fetchall()
    )
    conn.close()
    # Only events committed after every reader was connected measure delivery (earlier ones
    # are replays from the database, read as fast as the reader connects).
    start = max(min(t for _, t in g) for g in got)
    lags = [(t - committed[seq]) * 1000 for g in got for seq, t in g if committed[seq] >= start]
    complete = all([s for s, _ in g] == sorted(committed) for g in got)
    return {
        "readers": readers,
        "events": len(committed),
        "measured": len(lags),
        "p50_ms": statistics.median(lags),
        "p99_ms": pct(lags, 0.99),
        "every_reader_got_every_event_once_in_order": complete,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="smaller counts, for a smoke run")
    args = parser.parse_args()
    q = args.quick
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        print("1/4 creates…", file=sys.stderr)
        creates = bench_creates(base, 200 if q else 1000, 400 if q else 2000)
        print("2/4 appends…", file=sys.stderr)
        appends = bench_appends(base, 500 if q else 3000)
        print("3/4 recovery…", file=sys.stderr)
        recovery = bench_recovery(base, 1200 if q else 10_000)
        print("4/4 SSE…", file=sys.stderr)
        sse = bench_sse(base, 50 if q else 200, 100 if q else 200)
    results = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "when": time.strftime("%Y-%m-%d %H:%M"),
        "creates": creates,
        "appends": appends,
        "recovery": recovery,
        "sse": sse,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "control_plane.json").write_text(json.dumps(results, indent=2))
    ok = lambda b: "yes" if b else "**no**"  # noqa: E731
    table = f"""# Control-plane benchmark

{results["machine"]}, {results["when"]}. Command: `.venv/bin/python benchmarks/bench_control_plane.py`.

| measure | result | target | met |
| --- | --- | --- | --- |
| background create → 202, p50 | {creates["p50_ms"]:.2f} ms | ≤ 5 ms | {ok(creates["p50_ms"] <= 5)} |
| background create → 202, p99 | {creates["p99_ms"]:.2f} ms | | |
| creates/s, 8 concurrent clients (durable commits) | {creates["concurrent_rate"]:.0f} /s | ≥ 500 /s | {ok(creates["concurrent_rate"] >= 500)} |
| creates/s, one sequential client | {creates["sequential_rate"]:.0f} /s | | |
| event appends/s, store (`append_output`) | {appends["store_rate"]:.0f} /s | | |
| event appends/s, raw sqlite3, same transaction | {appends["raw_rate"]:.0f} /s | | |
| store / raw sqlite3 | {appends["ratio"]:.2f}× | ≥ 0.5× | {ok(appends["ratio"] >= 0.5)} |
| start-up recovery, {recovery["tasks"]} unfinished tasks | {recovery["seconds"]:.2f} s | ≤ 2 s | {ok(recovery["seconds"] <= 2)} |
| SSE delivery lag, {sse["readers"]} readers of one task, p50 | {sse["p50_ms"]:.1f} ms | | |
| SSE delivery lag, p99 | {sse["p99_ms"]:.1f} ms | ≤ 50 ms | {ok(sse["p99_ms"] <= 50)} |
| every reader got every event once, in order | {sse["every_reader_got_every_event_once_in_order"]} | | |
"""
    (RESULTS / "control_plane.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
