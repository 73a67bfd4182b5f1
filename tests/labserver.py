"""A real `jupyter lab` subprocess with the LMSP extension, for the browser tests.

Everything it writes is kept under one folder: notebooks (its root), database and models,
runtime files (so a kernel it starts finds it through its own runtime file), workspaces and
settings (so no earlier session is restored). It answers to a known token, exposes
`window.jupyterapp` to the page, and fetches no news or update information. Launching and
stopping it is `jupyter_lmsp.client.sandbox.LMSPServerProcess`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx
from serverproc import TOKEN, http_client

from jupyter_lmsp.client.sandbox import LMSPServerProcess


class LabServer(LMSPServerProcess):
    """`models` (name → model directory) are linked in; `env` is added to its environment;
    extra keyword arguments become `--LMSPExtension.<name>=<value>` options."""

    start_timeout = 120.0
    # Shutting its kernels down first takes a while.
    stop_timeout = 20.0

    def __init__(
        self,
        root: Path,
        *,
        default_model: str = "tiny",
        models: Mapping[str, str | Path] | None = None,
        env: Mapping[str, str] | None = None,
        **traits: Any,
    ) -> None:
        self.root = Path(root)
        self.notebooks = self.root / "notebooks"
        self.data = self.root / "data"
        super().__init__(
            self.data,
            token=TOKEN,
            default_model=default_model,
            models=models,
            traits=traits,
            app="jupyterlab",
            options=[
                "--LabApp.expose_app_in_browser=True",
                "--LabApp.news_url=",
                "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
                f"--LabApp.workspaces_dir={self.root / 'workspaces'}",
                f"--LabApp.user_settings_dir={self.root / 'settings'}",
            ],
            root_dir=self.notebooks,
            runtime_dir=self.root / "runtime",
            log_path=self.root / "lab.log",
            env=env,
        )
        self.notebooks.mkdir(parents=True, exist_ok=True)
        (self.data / "models").mkdir(parents=True, exist_ok=True)
        # No "get notified about Jupyter news?" toast over the page.
        settings = self.root / "settings" / "@jupyterlab" / "apputils-extension"
        settings.mkdir(parents=True, exist_ok=True)
        (settings / "notification.jupyterlab-settings").write_text('{"fetchNews": "false"}')

    @property
    def url(self) -> str:
        return f"{self.origin}/"

    def client(self) -> httpx.Client:
        # Generous: see ServerProcess.client.
        return http_client(base_url=self.api, headers=self.headers, timeout=120)
