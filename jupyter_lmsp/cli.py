"""`jupyter lmsp …`: the service's command line, working on the same database as the server.

jupyter lmsp tasks [--state STATE]     list tasks, newest first
jupyter lmsp models import-demo        convert the demo model (SmolLM2) into the model store
jupyter lmsp purge                     apply the retention period now
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from jupyter_core.paths import jupyter_data_dir

from .store import Database, queries, rules
from .store.database import sqlite_url


def default_data_dir() -> Path:
    return Path(jupyter_data_dir()) / "lmsp"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jupyter lmsp", description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, default=default_data_dir())
    sub = parser.add_subparsers(dest="command", required=True)
    tasks = sub.add_parser("tasks", help="list tasks")
    tasks.add_argument("--state", action="append")
    tasks.add_argument("--limit", type=int, default=20)
    models = sub.add_parser("models", help="manage models")
    models_sub = models.add_subparsers(dest="models_command", required=True)
    models_sub.add_parser("import-demo", help="convert the demo model into the model store")
    purge = sub.add_parser("purge", help="delete finished tasks older than the retention period")
    purge.add_argument("--retention-seconds", type=float, default=7 * 24 * 3600.0)
    args = parser.parse_args(argv)

    if args.command == "models":
        from .models.demo import ensure_demo_model

        path = ensure_demo_model(args.data_dir / "models")
        print(f"demo model ready: {path}")
        return 0

    db = Database(sqlite_url(args.data_dir / "lmsp.sqlite"))
    if args.command == "tasks":
        page = queries.list_tasks(db, states=args.state, limit=args.limit)
        for task in page.tasks:
            age = time.time() - task.created_at
            print(f"{task.id}  {task.state:<10}  {task.kind:<8}  {task.model:<24}  {age:8.0f}s ago")
        if not page.tasks:
            print("no tasks", file=sys.stderr)
    elif args.command == "purge":
        report = rules.purge_expired(db, args.retention_seconds)
        print(
            f"purged {report.tasks} task(s), {report.events} event(s), "
            f"{report.responses} response(s), {report.idempotency_keys} idempotency key(s)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
