"""Control-plane benchmark (issue 3): one command, measured side by side in one run.

    .venv/bin/python benchmarks/bench_control_plane.py [--quick] [--baseline REF] [--rounds N]

1. Background create → 202: latency p50/p99 of sequential POSTs, and the rate with 8 concurrent
   clients, against a real `jupyter server` with durable commits (synchronous=FULL). The
   worker holds one slow task, so the others stay queued: the create path is what is timed.
   With `--baseline REF` (e.g. `main`, or a commit), the same measurement runs against that
   checkout of the code too (a `git worktree` of REF, imported through PYTHONPATH by the
   server), alternating with this one for `--rounds` rounds, so both meet the same machine.
2. Event append rate: `rules.append_output` (one delta event + snapshot per transaction) against
   raw `sqlite3` doing the same transaction on the same kind of file, side by side.
3. Start-up recovery time for 10,000 unfinished tasks held by a server that died on this
   machine (`rules.recover_at_startup`, as a restarted server runs it).
4. Delivery lag p50/p99 to 200 concurrent SSE readers of one task (receive time − commit time).

Results go to benchmarks/results/control_plane.md (and .json).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
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


@contextmanager
def harness_gc_paused() -> Iterator[None]:
    """No cyclic garbage collection in this (the measuring) process while it times: a full
    collection of the harness's own heap stops it for 70-250 ms on this VM (measured with
    `gc.callbacks`), and every reader's receive time of the events then waiting, or the request
    then in flight, would count that pause as the service's latency. (As `timeit` does; the
    servers keep their collector: their pauses are the service's.)"""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def prepare_data_dir(base: Path) -> Path:
    (base / "models").mkdir(parents=True)
    make_test_model(base / "models" / "tiny")
    return base


# 1 -------------------------------------------------------------------------------------------
# One generation slot and a slow worker: the first task occupies it and the rest stay queued,
# so `time_creates` measures the create path (parse, commit, 202) rather than how fast the
# worker then runs thousands of tasks on the same two CPUs.
SLOW_SLOT = {"max_batch_size": 1, "engine_token_delay": 60}


def time_creates(server: ServerProcess, n_seq: int, per_thread: int) -> tuple[list[float], float]:
    """Background creates against `server` (started with `SLOW_SLOT`): the latencies (ms) of
    `n_seq` sequential POSTs after 20 warm-up ones, then the rate (per second) of 8 concurrent
    clients posting `per_thread` each (the harness's collector paused while it times)."""
    body = {"input": "hi", "background": True, "max_output_tokens": 1, "temperature": 0}
    with server.client() as c:
        for _ in range(20):  # warm up connections and code paths
            c.post("/responses", json=body)
        barrier = threading.Barrier(8)

        def worker() -> None:
            with server.client() as cc:
                barrier.wait()
                for _ in range(per_thread):
                    assert cc.post("/responses", json=body).status_code == 202

        threads = [threading.Thread(target=worker) for _ in range(8)]
        latencies = []
        with harness_gc_paused():
            for _ in range(n_seq):
                t = time.perf_counter()
                r = c.post("/responses", json=body)
                latencies.append((time.perf_counter() - t) * 1000)
                assert r.status_code == 202, r.text
            start = time.perf_counter()
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            elapsed = time.perf_counter() - start
    return latencies, per_thread * 8 / elapsed


def bench_creates(base: Path, n_seq: int, n_conc: int, env: dict[str, str] | None = None) -> dict:
    data = prepare_data_dir(Path(tempfile.mkdtemp(dir=base, prefix="creates-")))
    with ServerProcess(data, env=env, **SLOW_SLOT) as server:
        latencies, concurrent_rate = time_creates(server, n_seq, n_conc // 8)
    return {
        "p50_ms": statistics.median(latencies),
        "p99_ms": pct(latencies, 0.99),
        "sequential_rate": n_seq / (sum(latencies) / 1000),
        "concurrent_rate": concurrent_rate,
        "latencies": latencies,
    }


@contextmanager
def baseline_checkout(ref: str):  # type: ignore[no-untyped-def]
    """A `git worktree` of `ref` (detached), removed afterwards; yields (folder, commit)."""
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--verify", f"{ref}^{{commit}}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    folder = Path(tempfile.mkdtemp(prefix="lmsp-baseline-")) / "tree"
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(folder), commit],
        capture_output=True,
        check=True,
    )
    try:
        yield folder, commit
    finally:
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(folder)],
            capture_output=True,
        )


def bench_creates_side_by_side(
    base: Path, n_seq: int, n_conc: int, ref: str | None, rounds: int
) -> dict:
    """`bench_creates` for this code and, with `ref`, for that checkout, alternating rounds
    (this, baseline; then baseline, this; ...) so that both meet the same machine."""
    if ref is None:
        runs = [bench_creates(base, n_seq, n_conc) for _ in range(rounds)]
        return {"current": _merge(runs)}
    with baseline_checkout(ref) as (folder, commit):
        env = {"PYTHONPATH": str(folder)}
        current, baseline = [], []
        for i in range(rounds):
            order = [(current, None), (baseline, env)]
            for into, run_env in order if i % 2 == 0 else reversed(order):
                into.append(bench_creates(base, n_seq, n_conc, env=run_env))
    merged = {"current": _merge(current), "baseline": _merge(baseline)}
    merged["baseline"]["ref"] = f"{ref} ({commit[:10]})"
    merged["p50_ratio"] = merged["current"]["p50_ms"] / merged["baseline"]["p50_ms"]
    return merged


def _merge(runs: list[dict]) -> dict:
    latencies = [x for r in runs for x in r["latencies"]]
    return {
        "rounds": len(runs),
        "p50_ms": statistics.median(latencies),
        "p99_ms": pct(latencies, 0.99),
        "sequential_rate": statistics.median(r["sequential_rate"] for r in runs),
        "concurrent_rate": statistics.median(r["concurrent_rate"] for r in runs),
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

    from jupyter_lmsp.store import runners

    db = Database(sqlite_url(base / "recovery.sqlite"))
    states = ["queued", "loading", "running", "cancelling"]
    policies = [p.value for p in RestartPolicy]
    per = n // (len(states) * len(policies))
    ids = []
    for state in states:
        for policy in policies:
            ids += make_tasks(db, per, state, on_restart=policy)
    # They were held by a server that died on this machine: a process that has exited.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    held_by = runners.register(db, lease_seconds=3600).id
    conn = sqlite3.connect(base / "recovery.sqlite")
    conn.execute("UPDATE runners SET pid = ? WHERE id = ?", (dead.pid, held_by))
    conn.execute("UPDATE tasks SET runner_id = ?", (held_by,))
    conn.commit()
    conn.close()
    db.dispose()
    db = Database(sqlite_url(base / "recovery.sqlite"))  # the restarted server
    me = runners.register(db, lease_seconds=30).id
    t = time.perf_counter()
    report = rules.recover_at_startup(db, adopter=me)
    elapsed = time.perf_counter() - t
    assert report.runners == [(held_by, "process_gone")], report.runners
    assert report.examined == per * len(states) * len(policies)
    db.dispose()
    return {"tasks": report.examined, "seconds": elapsed, "transitions": report.transitions}


# 4 -------------------------------------------------------------------------------------------
class _SSESocket(asyncio.Protocol):
    """One SSE stream read straight off its socket: the HTTP/1.1 status line and headers, the
    chunked body, and its `id:` lines, each stamped with the time its bytes arrived.

    Why not httpx: with 200 readers in one process, the client's own work per stream is what
    gets timed. When a task ends, all 200 streams end at once, and httpx's teardown of each
    (response, connection, pool) delayed the others' receive stamps (scratch diagnosis on
    PostgreSQL, 5 rounds each: with httpx readers, in four rounds the closing events' slowest
    readers were at 370-920 ms; with socket readers, at most 30 ms, round p99 31-73 ms). Here
    each arrival costs one callback.
    """

    def __init__(self, received: list[tuple[int, float]]) -> None:
        self.received = received
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._buffer = b""  # bytes of the framing not yet parsed
        self._state = "head"  # head -> size -> data -> data_end -> size ... -> ended
        self._remaining = 0  # bytes left in the current chunk
        self._lines = b""  # the SSE text's unfinished last line

    def data_received(self, data: bytes) -> None:
        now = time.time()
        self._buffer += data
        try:
            while self._step(now):
                pass
        except ValueError as e:
            self._fail(str(e))

    def _step(self, now: float) -> bool:
        """Parse one piece of the buffer; False when more bytes are needed."""
        if self._state == "head":
            end = self._buffer.find(b"\r\n\r\n")
            if end < 0:
                return False
            head, self._buffer = self._buffer[:end].decode("latin-1"), self._buffer[end + 4 :]
            status, *fields = head.split("\r\n")
            if not status.startswith("HTTP/1.1 200"):
                raise ValueError(f"the stream answered {status!r}")
            if "transfer-encoding: chunked" not in (f.lower() for f in fields):
                raise ValueError("the stream is not chunked")
            self._state = "size"
        elif self._state == "size":
            end = self._buffer.find(b"\r\n")
            if end < 0:
                return False
            self._remaining = int(self._buffer[:end].split(b";")[0], 16)
            self._buffer = self._buffer[end + 2 :]
            self._state = "data" if self._remaining else "ended"
            if not self._remaining:
                if not self.done.done():
                    self.done.set_result(None)
                return False
        elif self._state == "data":
            if not self._buffer:
                return False
            piece = self._buffer[: self._remaining]
            self._buffer = self._buffer[len(piece) :]
            self._remaining -= len(piece)
            *lines, self._lines = (self._lines + piece).split(b"\n")
            for line in lines:
                if line.startswith(b"id: "):
                    self.received.append((int(line[4:]), now))
            if not self._remaining:
                self._state = "data_end"
        elif self._state == "data_end":
            if len(self._buffer) < 2:
                return False
            if self._buffer[:2] != b"\r\n":
                raise ValueError("a chunk does not end with CRLF")
            self._buffer = self._buffer[2:]
            self._state = "size"
        else:
            return False
        return True

    def _fail(self, message: str) -> None:
        if not self.done.done():
            self.done.set_exception(RuntimeError(message))

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(f"the stream closed before its end ({exc or 'no last chunk'})")


async def _reader(
    api: str,
    headers: dict[str, str],
    path: str,
    received: list[tuple[int, float]],
) -> None:
    url = httpx.URL(f"{api}{path}")
    transport, protocol = await asyncio.get_running_loop().create_connection(
        lambda: _SSESocket(received), url.host, url.port or 80
    )
    try:
        lines = [
            f"GET {url.raw_path.decode()}?stream=true HTTP/1.1",
            f"Host: {url.netloc.decode()}",
            "Accept: text/event-stream",
            *(f"{name}: {value}" for name, value in headers.items()),
            "Connection: close",
        ]
        transport.write(("\r\n".join(lines) + "\r\n\r\n").encode())
        await asyncio.wait_for(protocol.done, 300)
    finally:
        transport.close()


async def watch_one_task(
    creator: httpx.AsyncClient,
    watcher_api: str,
    watcher_headers: dict[str, str],
    readers: int,
    tokens: int,
) -> tuple[list[list[tuple[int, float]]], str]:
    """Create one greedy background task of `tokens` tokens through `creator` and read its
    events with `readers` concurrent SSE readers of `watcher_api` (a server's API root), each on
    its own connection: what each reader received (sequence number, receive time), and the
    task's id."""
    r = await creator.post(
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
    with harness_gc_paused():
        await asyncio.gather(
            *(
                _reader(watcher_api, watcher_headers, f"/tasks/{task_id}/events", got[i])
                for i in range(readers)
            )
        )
    return got, task_id


def delivery(
    got: list[list[tuple[int, float]]], committed: dict[int, float], start: float
) -> tuple[list[float], bool]:
    """The delivery lags (ms: receive time − commit time) of the events committed from `start`
    on, over every reader of `got`, and whether every reader got every event once, in order."""
    lags = [(t - committed[seq]) * 1000 for g in got for seq, t in g if committed[seq] >= start]
    return lags, all([s for s, _ in g] == sorted(committed) for g in got)


def bench_sse(base: Path, readers: int, tokens: int) -> dict:
    data = prepare_data_dir(base / "sse")
    with ServerProcess(data, engine_token_delay=0.05, snapshot_interval=0.0) as server:

        async def run() -> tuple[list[list[tuple[int, float]]], str]:
            async with httpx.AsyncClient(
                base_url=server.api, headers=server.headers, timeout=120
            ) as client:
                return await watch_one_task(client, server.api, server.headers, readers, tokens)

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
    lags, complete = delivery(got, committed, start=max(min(t for _, t in g) for g in got))
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
    parser.add_argument(
        "--baseline",
        metavar="REF",
        help="also measure creates with this git ref's code (e.g. main), side by side",
    )
    parser.add_argument("--rounds", type=int, default=3, help="create rounds per checkout")
    args = parser.parse_args()
    q = args.quick
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        print("1/4 creates…", file=sys.stderr)
        side = bench_creates_side_by_side(
            base, 200 if q else 1000, 400 if q else 2000, args.baseline, 1 if q else args.rounds
        )
        creates = side["current"]
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
        "creates_baseline": side.get("baseline"),
        "appends": appends,
        "recovery": recovery,
        "sse": sse,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    ok = lambda b: "yes" if b else "**no**"  # noqa: E731
    command_args = "".join(
        f" {flag}"
        for flag in ("--quick" if q else "", f"--baseline {args.baseline}" if args.baseline else "")
        if flag
    )
    table = f"""# Control-plane benchmark

{results["machine"]}, {results["when"]}. Command: `.venv/bin/python benchmarks/bench_control_plane.py{command_args}`.

| measure | result | target | met |
| --- | --- | --- | --- |
| background create → 202, p50 | {creates["p50_ms"]:.2f} ms | ≤ 5 ms | {ok(creates["p50_ms"] <= 5)} |
| background create → 202, p99 | {creates["p99_ms"]:.2f} ms | | |
| creates/s, 8 concurrent clients (durable commits) | {creates["concurrent_rate"]:.0f} /s | ≥ 500 /s | {ok(creates["concurrent_rate"] >= 500)} |
| creates/s, one sequential client | {creates["sequential_rate"]:.0f} /s | | |
{_baseline_rows(side)}| event appends/s, store (`append_output`) | {appends["store_rate"]:.0f} /s | | |
| event appends/s, raw sqlite3, same transaction | {appends["raw_rate"]:.0f} /s | | |
| store / raw sqlite3 | {appends["ratio"]:.2f}× | ≥ 0.5× | {ok(appends["ratio"] >= 0.5)} |
| start-up recovery, {recovery["tasks"]} unfinished tasks | {recovery["seconds"]:.2f} s | ≤ 2 s | {ok(recovery["seconds"] <= 2)} |
| SSE delivery lag, {sse["readers"]} readers of one task, p50 | {sse["p50_ms"]:.1f} ms | | |
| SSE delivery lag, p99 | {sse["p99_ms"]:.1f} ms | ≤ 50 ms | {ok(sse["p99_ms"] <= 50)} |
| every reader got every event once, in order | {sse["every_reader_got_every_event_once_in_order"]} | | |
"""
    if q:  # a smoke run leaves the recorded results alone
        print(table)
        return
    (RESULTS / "control_plane.json").write_text(json.dumps(results, indent=2))
    (RESULTS / "control_plane.md").write_text(table)
    print(table)


def _baseline_rows(side: dict) -> str:
    if "baseline" not in side:
        return ""
    b = side["baseline"]
    ratio = side["p50_ratio"]
    ok = "yes" if ratio <= 1.10 else "**no**"
    return (
        f"| background create → 202, p50, baseline {b['ref']} (same run, alternating rounds) "
        f"| {b['p50_ms']:.2f} ms | | |\n"
        f"| background create → 202, p99, baseline | {b['p99_ms']:.2f} ms | | |\n"
        f"| creates/s, 8 concurrent clients, baseline | {b['concurrent_rate']:.0f} /s | | |\n"
        f"| create → 202 p50, this / baseline | {ratio:.2f}× | ≤ 1.10× | {ok} |\n"
    )


if __name__ == "__main__":
    main()
