"""A real `jupyter server` subprocess with the extension, for crash and SDK tests.

It is started on 127.0.0.1 on a free port with its own data folder (database, models) and a
known token, and can be stopped politely or killed with SIGKILL mid-work.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

TOKEN = "lmsp-test-token"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(
        self,
        data_dir: Path,
        *,
        default_model: str = "tiny",
        env: dict[str, str] | None = None,
        **traits: Any,
    ) -> None:
        self.extra_env = env or {}
        self.data_dir = Path(data_dir)
        self.default_model = default_model
        self.traits = traits
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = self.data_dir / "server.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def api(self) -> str:
        return f"{self.url}/lmsp/v1"

    def start(self, timeout: float = 180) -> ServerProcess:
        args = [
            sys.executable,
            "-m",
            "jupyter_server",
            "--no-browser",
            "--allow-root",
            "--ip=127.0.0.1",
            f"--port={self.port}",
            "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={TOKEN}",
            f"--ServerApp.root_dir={self.data_dir}",
            "--ServerApp.jpserver_extensions=jupyter_lmsp=True",
            f"--LMSPExtension.data_dir={self.data_dir}",
            f"--LMSPExtension.default_model={self.default_model}",
        ]
        for name, value in self.traits.items():
            args.append(f"--LMSPExtension.{name}={value}")
        env = dict(os.environ, JUPYTER_PLATFORM_DIRS="1")
        env["JUPYTER_RUNTIME_DIR"] = str(self.data_dir / "runtime")
        env.update(self.extra_env)
        log = open(self.log_path, "ab")  # noqa: SIM115  (kept open for the child's lifetime)
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.log_path.read_text()[-3000:]}")
            if b"jupyter_lmsp | error" in self.log_path.read_bytes():
                self.proc.kill()
                raise RuntimeError(f"extension failed: {self.log_path.read_text()[-3000:]}")
            try:
                if self.client().get("/service").status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"server did not start: {self.log_path.read_text()[-3000:]}")

    def client(self, **kw: Any) -> httpx.Client:
        return httpx.Client(
            base_url=self.api, headers={"Authorization": f"token {TOKEN}"}, timeout=30, **kw
        )

    def kill(self) -> None:
        """SIGKILL, as a crash: nothing gets to run on the way down."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        # The worker notices its parent is gone; give it a moment so ports and files are free.
        time.sleep(0.2)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
