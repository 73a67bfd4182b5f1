"""A real `jupyter lab` subprocess with the LMSP extension, for the browser tests.

Everything it writes is kept under one folder: notebooks (its root), database and models,
runtime files (so a kernel it starts finds it through its own runtime file), workspaces and
settings (so no earlier session is restored). It answers to a known token, exposes
`window.jupyterapp` to the page, and fetches no news or update information.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from serverproc import TOKEN, free_port


class LabServer:
    def __init__(self, root: Path, *, default_model: str = "tiny", **traits: Any) -> None:
        self.root = Path(root)
        self.default_model = default_model
        self.traits = traits
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = self.root / "lab.log"
        self.notebooks = self.root / "notebooks"
        self.data = self.root / "data"
        self.notebooks.mkdir(parents=True, exist_ok=True)
        (self.data / "models").mkdir(parents=True, exist_ok=True)
        # No "get notified about Jupyter news?" toast over the page.
        settings = self.root / "settings" / "@jupyterlab" / "apputils-extension"
        settings.mkdir(parents=True, exist_ok=True)
        (settings / "notification.jupyterlab-settings").write_text('{"fetchNews": "false"}')

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"

    def start(self, timeout: float = 120) -> LabServer:
        args = [
            sys.executable,
            "-m",
            "jupyterlab",
            "--no-browser",
            "--allow-root",
            "--ip=127.0.0.1",
            f"--port={self.port}",
            "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={TOKEN}",
            f"--ServerApp.root_dir={self.notebooks}",
            "--ServerApp.jpserver_extensions=jupyter_lmsp=True",
            "--LabApp.expose_app_in_browser=True",
            "--LabApp.news_url=",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
            f"--LabApp.workspaces_dir={self.root / 'workspaces'}",
            f"--LabApp.user_settings_dir={self.root / 'settings'}",
            f"--LMSPExtension.data_dir={self.data}",
            f"--LMSPExtension.default_model={self.default_model}",
        ]
        args += [f"--LMSPExtension.{name}={value}" for name, value in self.traits.items()]
        env = dict(os.environ, JUPYTER_PLATFORM_DIRS="1")
        env["JUPYTER_RUNTIME_DIR"] = str(self.root / "runtime")
        # The kernel must find this server through its runtime file, not through these.
        for name in ("LMSP_URL", "LMSP_TOKEN"):
            env.pop(name, None)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"jupyter lab exited: {self.log_path.read_text()[-3000:]}")
            try:
                r = httpx.get(
                    self.url + "lmsp/v1/service",
                    headers={"Authorization": f"token {TOKEN}"},
                    timeout=5,
                )
                if r.status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"jupyter lab did not start: {self.log_path.read_text()[-3000:]}")

    def client(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.url + "lmsp/v1", headers={"Authorization": f"token {TOKEN}"}, timeout=30
        )

    def stop(self) -> None:
        """Stop by pid: SIGTERM (the server shuts its kernels down), SIGKILL if it hangs."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
