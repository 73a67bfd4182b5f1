"""`jupyter lmsp doctor`: the state of a data folder's database, for a person to read.

It says which schema revision the database is at (and whether a server would upgrade it, or
refuse it), whether SQLite finds it sound (integrity and foreign keys), which runners (servers)
hold leases on it and whether each is alive, and which tasks are unfinished and who holds
them — nothing a server would not tell, but without a server. It never changes the database:
it opens it without upgrading it, and only reads.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .store import backup, runners, webhooks
from .store.database import Database, sqlite_url
from .store.inventory import UnfinishedTask, row_counts, unfinished_by_holder, unfinished_tasks
from .store.schema import SchemaStatus
from .store.tables import Runner


@dataclass
class RunnerState:
    runner: Runner
    gone: str | None  # why it is gone, or None while alive
    tasks: Counter[str] = field(default_factory=Counter)  # unfinished tasks it holds, by state


@dataclass
class Diagnosis:
    path: Path
    size_bytes: int
    schema: SchemaStatus
    problems: list[str]
    runners: list[RunnerState]
    unfinished: list[UnfinishedTask]
    unfinished_total: int
    unheld: Counter[str]
    counts: dict[str, int]
    blas: dict[str, Any] | None = None
    # Webhook deliveries by state (pending, delivered, dead): issue 38's outbox.
    webhooks: dict[str, int] = field(default_factory=dict)

    @property
    def healthy(self) -> bool:
        return not self.problems and self.schema.state in ("current", "old", "empty")


def examine(path: Path, *, quick: bool = False, limit: int = 20) -> Diagnosis:
    """Read everything `doctor` reports from the database file at `path`."""
    size = sum(
        (path.parent / f"{path.name}{suffix}").stat().st_size
        for suffix in ("", "-wal")
        if (path.parent / f"{path.name}{suffix}").exists()
    )
    db = Database(sqlite_url(path), upgrade=False)
    try:
        status = db.schema.status
        problems = backup.integrity(path, quick=quick)
        if status.state != "current":
            # The tables below are the current schema's; an older database is described by
            # its revision alone until a server upgrades it.
            return Diagnosis(path, size, status, problems, [], [], 0, Counter(), {})
        now = time.time()
        here = runners.this_process()
        states = [
            RunnerState(r, runners.gone_reason(r, now, here)) for r in runners.list_runners(db)
        ]
        by_id = {s.runner.id: s for s in states}
        unheld: Counter[str] = Counter()
        for runner_id, state, n in unfinished_by_holder(db):
            if runner_id in by_id:
                by_id[runner_id].tasks[state] += n
            else:
                unheld[state] += n
        listed, total = unfinished_tasks(db, limit)
        return Diagnosis(
            path,
            size,
            status,
            problems,
            states,
            listed,
            total,
            unheld,
            row_counts(db),
            webhooks=webhooks.counts(db),
        )
    finally:
        db.dispose()


def blas(threads: int | None = None) -> dict[str, Any]:
    """The inference worker's BLAS choice as a server with the default settings makes it (its
    cached verdict when there is one, else a probe of the candidates)."""
    import os

    from .engine.blas import blas_report

    if threads is None:  # the extension's default `blas_threads`
        threads = 1 if (os.cpu_count() or 1) <= 2 else 0
    return blas_report(threads=threads)


def render(d: Diagnosis) -> str:
    now = time.time()
    lines = [
        f"database: {d.path} ({_size(d.size_bytes)})",
        f"schema:   {d.schema.describe}",
        "check:    " + ("ok" if not d.problems else f"{len(d.problems)} problem(s)"),
    ]
    lines += [f"  - {p}" for p in d.problems[:20]]
    if d.schema.state != "current":
        return "\n".join(lines)
    lines.append(
        "rows:     " + ", ".join(f"{n} {table.replace('_', ' ')}" for table, n in d.counts.items())
    )
    lines.append("")
    lines.append(f"runners (servers driving tasks): {len(d.runners)}")
    for s in d.runners:
        r = s.runner
        if s.gone is None:
            left = r.lease_expires_at - now
            lease = f"alive, lease {'expires in' if left >= 0 else 'expired'} {abs(left):.0f}s"
            if left < 0:
                lease += " ago (its process runs on this machine)"
        else:
            why = "its process is gone" if s.gone == "process_gone" else "its lease expired"
            lease = f"GONE ({why}): the next server start or sweep recovers its tasks"
        held = ", ".join(f"{n} {state}" for state, n in sorted(s.tasks.items())) or "none"
        lines.append(f"  {r.id}  {r.kind} pid {r.pid} on {r.host}, up {_age(now - r.started_at)}")
        lines.append(f"      {lease}; heartbeat {_age(now - r.heartbeat_at)} ago")
        lines.append(f"      unfinished tasks held: {held}")
    if d.unheld:
        held = ", ".join(f"{n} {state}" for state, n in sorted(d.unheld.items()))
        lines.append(f"  (no runner) {held}: recovered by the next server start or sweep")
    lines.append("")
    lines.append(f"unfinished tasks: {d.unfinished_total}")
    for t in d.unfinished:
        holder = t.runner_id or "no runner"
        lines.append(
            f"  {t.id}  {t.state:<10}  {t.on_restart:<6}  {t.kind:<8}  {t.owner:<20}"
            f"  {_age(now - t.created_at):>8} old  held by {holder}"
        )
    if d.unfinished_total > len(d.unfinished):
        lines.append(f"  … and {d.unfinished_total - len(d.unfinished)} more")
    if d.webhooks:
        lines.append("")
        lines.append(
            f"webhook deliveries: {d.webhooks.get('pending', 0)} pending, "
            f"{d.webhooks.get('dead', 0)} dead"
            + (
                " (dead letters: GET /lmsp/v1/webhooks/{id}/deliveries?status=dead, then "
                "POST …/deliveries/{delivery_id}/redeliver)"
                if d.webhooks.get("dead")
                else ""
            )
        )
    if d.blas is not None:
        from .engine.blas.__main__ import render as render_blas

        lines += ["", "inference worker BLAS:", render_blas(d.blas)]
    return "\n".join(lines)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"


def _age(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    if seconds < 172800:
        return f"{seconds / 3600:.0f}h"
    return f"{seconds / 86400:.0f}d"
