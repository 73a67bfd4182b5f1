"""A throw-away PostgreSQL cluster for the tests: Debian's `postgresql` binaries (`make test`
installs the package when missing), `initdb` and `pg_ctl` in a temporary folder, on a free
port, no container runtime. PostgreSQL refuses to run as root, so as root the binaries run as
the `postgres` user (`runuser`). Each test gets a database of its own (`PgCluster.new_database`).

Without the binaries the tests that need the cluster are skipped, or fail when `CI` is set
(`prerequisites.require`).
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from jupyter_lmsp.protocol.ids import new_id

USER = "lmsp"


def pg_bindir() -> Path | None:
    """Where `initdb` and `pg_ctl` are: $LMSP_PG_BINDIR, Debian's newest version, or $PATH."""
    if os.environ.get("LMSP_PG_BINDIR"):
        return Path(os.environ["LMSP_PG_BINDIR"])
    found = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"),
        key=lambda p: (
            int(Path(p).parent.parent.name) if Path(p).parent.parent.name.isdigit() else 0
        ),
    )
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PgCluster:
    """A running cluster in `directory`, stopped by `stop()`."""

    def __init__(self, directory: Path, bindir: Path, *, fsync: bool = False) -> None:
        self.directory = directory
        self.bindir = bindir
        self.port = _free_port()
        self.as_root = os.geteuid() == 0
        directory.mkdir(parents=True, exist_ok=True)
        if self.as_root:
            shutil.chown(directory, "postgres")
            directory.chmod(0o755)
        data = directory / "data"
        self._run("initdb", "-D", str(data), "-A", "trust", "-U", USER, "--no-sync", "-E", "UTF8")
        options = (
            f"-p {self.port} -k {directory} -c listen_addresses=127.0.0.1"
            # Many servers and workers in one test, each with a small pool.
            " -c max_connections=300 -c shared_buffers=32MB" + ("" if fsync else " -c fsync=off")
            # fsync off in the tests only, to spare the shared machine's disk: no test kills
            # the cluster itself. synchronous_commit (what the service relies on) stays on;
            # the benchmarks keep fsync on too.
        )
        self._run(
            "pg_ctl", "-D", str(data), "-w", "-o", options, "-l", str(directory / "log"), "start"
        )

    def _run(self, program: str, *args: str) -> None:
        command = [str(self.bindir / program), *args]
        if self.as_root:
            command = ["runuser", "-u", "postgres", "--", *command]
        subprocess.run(command, check=True, capture_output=True, timeout=120)

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://{USER}@127.0.0.1:{self.port}/{database}"

    def dsn(self, database: str = "postgres") -> str:
        return f"host=127.0.0.1 port={self.port} user={USER} dbname={database}"

    def new_database(self) -> str:
        """A new, empty database; its SQLAlchemy URL."""
        import psycopg

        name = new_id("db").lower()
        with psycopg.connect(self.dsn(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def stop(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError):
            self._run("pg_ctl", "-D", str(self.directory / "data"), "-m", "immediate", "stop")
        shutil.rmtree(self.directory, ignore_errors=True)


def start_cluster(*, fsync: bool = False) -> PgCluster | None:
    """A cluster in a new folder of /tmp (which the `postgres` user can reach, unlike pytest's
    private temporary folders), or None when PostgreSQL is not installed here."""
    bindir = pg_bindir()
    if bindir is None or not (bindir / "initdb").exists():
        return None
    directory = Path(tempfile.mkdtemp(prefix="lmsp-pg-"))
    deadline = time.monotonic() + 3
    while True:
        try:
            return PgCluster(directory, bindir, fsync=fsync)
        except subprocess.CalledProcessError:
            # The port chosen was taken meanwhile by someone else: once more on another.
            if time.monotonic() > deadline:
                raise
            shutil.rmtree(directory / "data", ignore_errors=True)
