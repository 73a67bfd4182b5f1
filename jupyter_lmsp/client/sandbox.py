"""`SandboxServer`: a private `jupyter server` with the LMSP extension, for demonstrations.

The notebook about restart policies needs a server it may kill with SIGKILL and start again
without taking the notebook's own kernel down with it. A sandbox is a child process of the
caller on 127.0.0.1 and a free port, with its own data folder (database, model links, runtime
files) and a random token; `kill()` crashes it, `start()` brings it back on the same port and
database, and start-up recovery (LMSP 11.3) runs as it would after a real crash.
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
from pathlib import Path
from typing import Any

import httpx

from .api import Client


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SandboxServer:
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
        self._tmp = None if data_dir else tempfile.TemporaryDirectory(prefix="lmsp-sandbox-")
        self.data_dir = Path(data_dir or self._tmp.name)  # type: ignore[union-attr]
        (self.data_dir / "models").mkdir(parents=True, exist_ok=True)
        for name, path in models.items():
            link = self.data_dir / "models" / name
            if not link.exists():
                link.symlink_to(Path(path).resolve())
        self.default_model = default_model or next(iter(models))
        self.traits = traits
        self.token = secrets.token_hex(16)
        self.port = _free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = self.data_dir / "server.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"

    def client(self) -> Client:
        return Client(self.url, self.token)

    def start(self, timeout: float = 60) -> SandboxServer:
        args = [
            sys.executable,
            "-m",
            "jupyter_server",
            "--no-browser",
            "--ip=127.0.0.1",
            f"--port={self.port}",
            "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={self.token}",
            f"--ServerApp.root_dir={self.data_dir}",
            "--ServerApp.jpserver_extensions=jupyter_lmsp=True",
            f"--LMSPExtension.data_dir={self.data_dir}",
            f"--LMSPExtension.default_model={self.default_model}",
        ]
        if hasattr(os, "getuid") and os.getuid() == 0:
            args.append("--allow-root")
        args += [f"--LMSPExtension.{name}={value}" for name, value in self.traits.items()]
        env = dict(os.environ, JUPYTER_PLATFORM_DIRS="1")
        # Its own runtime folder: it must not look like the notebook's server to discovery.
        env["JUPYTER_RUNTIME_DIR"] = str(self.data_dir / "runtime")
        for name in ("LMSP_URL", "LMSP_TOKEN"):
            env.pop(name, None)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        headers = {"Authorization": f"token {self.token}"}
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sandbox server exited:\n{self.log_path.read_text()[-3000:]}")
            try:
                r = httpx.get(self.url + "lmsp/v1/service", headers=headers, timeout=5)
                if r.status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"sandbox server did not start:\n{self.log_path.read_text()[-3000:]}")

    def kill(self) -> None:
        """SIGKILL: a crash, nothing runs on the way down."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
            # Its inference worker notices the parent is gone; let it release the database.
            time.sleep(0.3)

    def stop(self) -> None:
        """A polite shutdown."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def close(self) -> None:
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> SandboxServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        running = self.proc is not None and self.proc.poll() is None
        return f"SandboxServer(url={self.url!r}, running={running})"
