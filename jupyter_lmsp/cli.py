"""`jupyter lmsp …`: the service's command line, working on the same database as the server.

jupyter lmsp tasks [--state STATE]     list tasks, newest first
jupyter lmsp models import-demo        convert the demo model (SmolLM2) into the model store
jupyter lmsp purge                     apply the retention period now
jupyter lmsp backup PATH               copy the database, online and consistent
jupyter lmsp restore PATH [--force]    replace the database with a backup (servers stopped)
jupyter lmsp doctor [--quick] [--blas] schema version, checks, runners, unfinished tasks

The work of `backup`, `restore` and `doctor` is in `store.backup` and `doctor`; this module
only parses the command line and prints.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from jupyter_core.paths import jupyter_data_dir

from .auth import pairing
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
    backup = sub.add_parser("backup", help="copy the database (online, consistent) to PATH")
    backup.add_argument("path", type=Path)
    restore = sub.add_parser("restore", help="replace the database with the backup at PATH")
    restore.add_argument("path", type=Path)
    restore.add_argument(
        "--force", action="store_true", help="even while a server holds a lease on it"
    )
    doctor = sub.add_parser("doctor", help="schema, integrity, runners and unfinished tasks")
    doctor.add_argument("--quick", action="store_true", help="SQLite's quick check only")
    doctor.add_argument("--limit", type=int, default=20, help="unfinished tasks to list")
    doctor.add_argument(
        "--blas",
        action="store_true",
        help="also the inference worker's BLAS choice (probes the candidates if no server "
        "has cached a verdict)",
    )
    args = parser.parse_args(argv)

    if args.command == "models":
        from .models.demo import ensure_demo_model

        path = ensure_demo_model(args.data_dir / "models")
        print(f"demo model ready: {path}")
        return 0

    database = args.data_dir / "lmsp.sqlite"
    if args.command in ("backup", "restore", "doctor"):
        return _maintenance(database, args)
    db = Database(sqlite_url(database))
    try:
        return _run(db, args)
    except LMSPError as e:
        print(f"error: {e.message}", file=sys.stderr)
        return 1


def _maintenance(database: Path, args: argparse.Namespace) -> int:
    """backup, restore, doctor: on the database file, without opening it as a server would
    (no upgrade)."""
    from . import doctor
    from .store import backup

    try:
        if args.command == "doctor":
            if not database.exists():
                print(f"no database at {database}", file=sys.stderr)
                return 1
            diagnosis = doctor.examine(database, quick=args.quick, limit=args.limit)
            if args.blas:
                diagnosis.blas = doctor.blas()
            print(doctor.render(diagnosis))
            return 0 if diagnosis.healthy else 1
        if args.command == "backup":
            with _progress(f"backing up {database}") as progress:
                report = backup.backup(database, args.path, progress)
            print(f"backup written to {report.path} ({report.bytes} bytes, {report.seconds:.1f}s)")
            return 0
        described = backup.check_restorable(args.path, database, force=args.force)
        if database.exists():
            keep = database.with_name(
                f"{database.name}.before-restore-{time.strftime('%Y%m%d-%H%M%S')}"
            )
            with _progress(f"keeping the current database as {keep.name}") as progress:
                backup.backup(database, keep, progress)
        with _progress(f"restoring {args.path}") as progress:
            report = backup.restore(args.path, database, progress)
        print(f"restored {database} from {args.path} ({described}, {report.seconds:.1f}s)")
        return 0
    except backup.BackupError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


@contextmanager
def _progress(what: str) -> Iterator[Callable[[int, int], None]]:
    """A progress bar over pages copied (on stderr), as a callback for store.backup."""
    from tqdm import tqdm

    bar = tqdm(desc=what, unit="page", file=sys.stderr, leave=False)

    def update(done: int, total: int) -> None:
        bar.total = total
        bar.n = done
        bar.refresh()

    try:
        yield update
    finally:
        bar.close()


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
            # As the user the server runs for (auth.scopes.OWNER): the client is theirs.
            p = pairing.decide(db, args.code, args.pair_command == "approve", scopes)
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
