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

from .auth import pairing
from .auth.identity import server_owner
from .protocol.errors import LMSPError
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
    pair = sub.add_parser("pair", help="pairing requests")
    pair_sub = pair.add_subparsers(dest="pair_command", required=True)
    pair_sub.add_parser("list", help="pairing requests waiting for approval")
    approve = pair_sub.add_parser("approve", help="approve a pairing request")
    approve.add_argument("code", help="the user code (e.g. WDJB-MJHT) or the pairing id")
    approve.add_argument("--scopes", help="comma-separated subset of the requested scopes")
    deny = pair_sub.add_parser("deny", help="deny a pairing request")
    deny.add_argument("code")
    clients = sub.add_parser("clients", help="paired clients")
    clients_sub = clients.add_subparsers(dest="clients_command", required=True)
    clients_sub.add_parser("list", help="paired clients")
    revoke = clients_sub.add_parser("revoke", help="revoke a client's token")
    revoke.add_argument("client_id")
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
    try:
        return _run(db, args)
    except LMSPError as e:
        print(f"error: {e.message}", file=sys.stderr)
        return 1


def _run(db: Database, args: argparse.Namespace) -> int:
    if args.command == "pair":
        if args.pair_command == "list":
            rows = pairing.pending(db)["data"]
            for p in rows:
                left = p["expires_at"] - time.time()
                print(
                    f"{p['user_code']}  {p['client_name']:<24}  {','.join(p['requested_scopes'])}"
                    f"  (expires in {left:.0f}s)  {p['id']}"
                )
            if not rows:
                print("no pairing requests waiting", file=sys.stderr)
        else:
            scopes = None
            if args.pair_command == "approve" and args.scopes:
                scopes = [s.strip() for s in args.scopes.split(",") if s.strip()]
            p = pairing.decide(
                db, args.code, args.pair_command == "approve", scopes, decided_by=server_owner()
            )
            print(f"{p['status']}: {p['client_name']} ({','.join(p['granted_scopes'] or [])})")
        return 0
    if args.command == "clients":
        if args.clients_command == "list":
            rows = pairing.list_clients(db)["data"]
            for c in rows:
                used = (
                    time.strftime("%Y-%m-%d %H:%M", time.localtime(c["last_used_at"]))
                    if c["last_used_at"]
                    else "never"
                )
                print(f"{c['id']}  {c['name']:<24}  {','.join(c['scopes'])}  last used {used}")
            if not rows:
                print("no paired clients", file=sys.stderr)
        else:
            c = pairing.revoke(db, args.client_id)
            print(f"revoked {c['id']} ({c['name']})")
        return 0
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
