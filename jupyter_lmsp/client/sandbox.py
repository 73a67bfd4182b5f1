"""Private `jupyter server` processes with the LMSP extension: `SandboxServer` for
demonstrations, and `LMSPServerProcess`, the launcher it is built on.

The notebook about restart policies needs a server it may kill with SIGKILL and start again
without taking the notebook's own kernel down with it. A sandbox is a child process of the
caller on 127.0.0.1 and a free port, with its own data folder (database, model links, runtime
files) and a random token; `kill()` crashes it, `start()` brings it back on the same port and
database, and start-up recovery (LMSP 11.3) runs as it would after a real crash.

`LMSPServerProcess` is what every such server has in common: its command line and
environment, waiting until its service answers, stopping and killing it. The test suite's
servers (tests/serverproc.py, tests/labserver.py) and the engine benchmark start theirs
through it as well.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Self

import httpx

from .api import Client


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LMSPServerProcess:
    """A Jupyter server child process with the LMSP extension, on 127.0.0.1 and a free port,
    answering to `token`.

    `data_dir` holds the service's database and model links, and is also the server's root
    folder, the parent of its runtime folder (`runtime/`) and the place of its log
    (`server.log`) unless `root_dir`, `runtime_dir` or `log_path` say otherwise. `models`
    (name → model directory) are linked into `data_dir/models`. `traits` become
    `--LMSPExtension.<name>=<value>` options; `options` are further command-line options for
    `app` (the module run with `python -m`, e.g. `jupyterlab`); `env` is added to the
    environment.
    """

    start_timeout = 60.0
    stop_timeout = 15.0
    # After a SIGKILL the inference worker needs a moment to notice its parent is gone and to
    # let go of the database and the port.
    kill_settle = 0.3

    def __init__(
        self,
        data_dir: str | Path,
        *,
        token: str,
        default_model: str | None = None,
        models: Mapping[str, str | Path] | None = None,
        traits: Mapping[str, Any] | None = None,
        app: str = "jupyter_server",
        options: Iterable[str] = (),
        root_dir: str | Path | None = None,
        runtime_dir: str | Path | None = None,
        log_path: str | Path | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.token = token
        self.default_model = default_model
        self.traits = dict(traits or {})
        self.app = app
        self.options = list(options)
        self.root_dir = Path(root_dir) if root_dir is not None else self.data_dir
        self.runtime_dir = (
            Path(runtime_dir) if runtime_dir is not None else self.data_dir / "runtime"
        )
        self.log_path = Path(log_path) if log_path is not None else self.data_dir / "server.log"
        self.extra_env = dict(env or {})
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        for name, path in (models or {}).items():
            link = self.data_dir / "models" / name
            link.parent.mkdir(parents=True, exist_ok=True)
            if not link.exists():
                link.symlink_to(Path(path).resolve())

    @property
    def origin(self) -> str:
        """`http://127.0.0.1:<port>`, without a trailing slash."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def api(self) -> str:
        """The base URL of the LMSP API, without a trailing slash."""
        return f"{self.origin}/lmsp/v1"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"token {self.token}"}

    def command(self) -> list[str]:
        args = [
            sys.executable,
            "-m",
            # `python -m <app>`, with an import that costs every start a second deferred.
            "jupyter_lmsp.launch",
            self.app,
            "--no-browser",
            *(["--allow-root"] if hasattr(os, "getuid") and os.getuid() == 0 else []),
            "--ip=127.0.0.1",
            f"--port={self.port}",
            "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={self.token}",
            f"--ServerApp.root_dir={self.root_dir}",
            "--ServerApp.jpserver_extensions=jupyter_lmsp=True",
            *self.options,
            f"--LMSPExtension.data_dir={self.data_dir}",
        ]
        if self.default_model is not None:
            args.append(f"--LMSPExtension.default_model={self.default_model}")
        args += [f"--LMSPExtension.{name}={value}" for name, value in self.traits.items()]
        return args

    def environment(self) -> dict[str, str]:
        env = dict(os.environ, JUPYTER_PLATFORM_DIRS="1")
        # A runtime folder of its own: its kernels find this server through its runtime file,
        # and discovery elsewhere (the caller's own kernel) does not mistake it for theirs.
        env["JUPYTER_RUNTIME_DIR"] = str(self.runtime_dir)
        # Its kernels must find this server, not the one the caller may be pointed at.
        for name in ("LMSP_URL", "LMSP_TOKEN"):
            env.pop(name, None)
        env.update(self.extra_env)
        return env

    def start(self, timeout: float | None = None) -> Self:
        """Start the server and return once its service answers.

        Raises RuntimeError (with the end of the log) if the server exits, if the extension
        fails to load, or if the service does not answer within `timeout` seconds (default
        `start_timeout`); in the last two cases the server is stopped first.
        """
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log_start = log.tell()
            self.proc = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, env=self.environment()
            )
        self._wait_until_ready(self.start_timeout if timeout is None else timeout, log_start)
        return self

    def _wait_until_ready(self, timeout: float, log_start: int) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        # One client for the whole wait: a client of its own per try (`httpx.get`) builds a new
        # TLS context each time, ~25 ms of CPU, 20-50 times per start on a busy machine.
        with httpx.Client(headers=self.headers, timeout=5) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"{self.app} exited with code {self.proc.returncode}:\n{self.log_tail()}"
                    )
                # Jupyter keeps serving without an extension that failed to load: the service
                # would never answer, so there is nothing to wait for.
                if b"jupyter_lmsp | error" in self._log_since(log_start):
                    self.kill()
                    raise RuntimeError(f"the LMSP extension failed to load:\n{self.log_tail()}")
                try:
                    if client.get(f"{self.api}/service").status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"{self.app} did not start in {timeout} s:\n{self.log_tail()}")

    def _log_since(self, offset: int) -> bytes:
        with open(self.log_path, "rb") as log:
            log.seek(offset)
            return log.read()

    def log_tail(self, chars: int = 3000) -> str:
        """The end of the server's log."""
        return self.log_path.read_text(errors="replace")[-chars:]

    def kill(self) -> None:
        """SIGKILL: a crash, nothing runs on the way down."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        time.sleep(self.kill_settle)

    def stop(self) -> None:
        """A polite shutdown (SIGTERM: the server shuts its kernels down), SIGKILL if it hangs
        for more than `stop_timeout` seconds."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(self.stop_timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def __enter__(self) -> Self:
        # `with server.start() as s:` must not start a second server (and leak the first).
        return self if self.running else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class SandboxServer(LMSPServerProcess):
    """A throwaway Jupyter server serving `models` (name → MLX model directory).

    Extra keyword arguments become `--LMSPExtension.<name>=<value>` options.
    """

    def __init__(
        self,
        models: dict[str, str | Path],
        *,
        default_model: str | None = None,
        data_dir: str | Path | None = None,
        **traits: Any,
    ) -> None:
        if not models:
            raise ValueError("a sandbox needs at least one model")
        self._tmp = None
        if data_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="lmsp-sandbox-")
            data_dir = self._tmp.name
        super().__init__(
            data_dir,
            token=secrets.token_hex(16),
            default_model=default_model or next(iter(models)),
            models=models,
            traits=traits,
        )

    @property
    def url(self) -> str:
        return f"{self.origin}/"

    def client(self) -> Client:
        return Client(self.url, self.token)

    def close(self) -> None:
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SandboxServer(url={self.url!r}, running={self.running})"
