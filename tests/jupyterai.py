"""Jupyter AI in a virtual environment of its own, for tests/test_jupyter_ai.py.

`make jupyter-ai` (a prerequisite of `make test`) makes `.venv-jupyter-ai` from
tests/jupyter-ai-requirements.txt (jupyter-ai 3.2.0 with its Jupyternaut persona, everything
pinned) and leaves a copy of those pins in the folder as its stamp. `require_jupyter_ai()` skips
the test when the folder is missing or was made from other pins, and fails when `CI` is set
(tests/prerequisites.py). `LMSP_TEST_JUPYTER_AI_VENV` points the test at another folder.

`JupyterAIServer` is a `jupyter server` process of that environment: Jupyter AI's server
extensions loaded, configured as a user would (a `jupyter_server_config.json` in its own
configuration folder, the API key in `OPENAI_API_KEY`), on a free port with a known token.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
from prerequisites import require

ROOT = Path(__file__).resolve().parent.parent
PINS = Path(__file__).parent / "jupyter-ai-requirements.txt"
VENV = Path(os.environ.get("LMSP_TEST_JUPYTER_AI_VENV") or ROOT / ".venv-jupyter-ai")
TOKEN = "jupyter-ai-test-token"


def require_jupyter_ai() -> Path:
    """The environment's `jupyter` launcher, once it is made from the current pins (else skip,
    or fail in CI)."""
    jupyter = VENV / "bin" / "jupyter"
    stamp = VENV / ".installed"
    require(jupyter.exists(), f"jupyter-ai 3.2.0 in {VENV}: `make jupyter-ai`")
    require(
        stamp.exists() and stamp.read_text() == PINS.read_text(),
        f"{VENV} made from the current {PINS.name} (it is stale or unfinished): `make jupyter-ai`",
    )
    return jupyter


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class JupyterAIServer:
    """`jupyter server` from the Jupyter AI environment, with `server_config` written as its
    `jupyter_server_config.json` and `env` added to its environment. Its folders (root,
    configuration, data, runtime) are under `home`; its log is `home/server.log`."""

    start_timeout = 120.0

    def __init__(self, home: Path, server_config: dict[str, Any], env: dict[str, str]) -> None:
        self.home = home
        self.port = free_port()
        self.root = home / "root"
        self.log_path = home / "server.log"
        for folder in ("root", "config", "data", "runtime"):
            (home / folder).mkdir(parents=True, exist_ok=True)
        (home / "config" / "jupyter_server_config.json").write_text(json.dumps(server_config))
        self.env = {
            **os.environ,
            "JUPYTER_CONFIG_DIR": str(home / "config"),
            "JUPYTER_DATA_DIR": str(home / "data"),
            "JUPYTER_RUNTIME_DIR": str(home / "runtime"),
            # LiteLLM reads its model list from the package (no fetch from the network).
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            **env,
        }
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def origin(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> JupyterAIServer:
        command = [
            str(require_jupyter_ai()),
            "server",
            "--no-browser",
            f"--port={self.port}",
            "--ip=127.0.0.1",
            f"--ServerApp.root_dir={self.root}",
            f"--IdentityProvider.token={TOKEN}",
            "--allow-root",
        ]
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                command, env=self.env, stdout=log, stderr=subprocess.STDOUT, cwd=self.root
            )
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"jupyter server exited: {self.log()}")
            try:
                r = httpx.get(f"{self.origin}/api/status", params={"token": TOKEN}, timeout=2)
                if r.status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.__exit__(None, None, None)
        raise TimeoutError(f"jupyter server did not start: {self.log()}")

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]
