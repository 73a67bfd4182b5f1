"""A real `jupyter server` subprocess with the extension, for crash and SDK tests.

It is started on 127.0.0.1 on a free port with its own data folder (database, models) and a
known token, and can be stopped politely or killed with SIGKILL mid-work. The launching itself
(command line, environment, readiness, shutdown) is the package's
`jupyter_lmsp.client.sandbox.LMSPServerProcess`, which the sandbox and the benchmarks use too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from jupyter_lmsp.client.sandbox import LMSPServerProcess

TOKEN = "lmsp-test-token"
# One TLS context for every test client: httpx builds a new one (loading the CA bundle, ~25 ms
# of CPU) for each client made without it, and the suite makes thousands. The test servers
# speak plain HTTP; it is never used for anything but being there.
TLS = httpx.create_ssl_context()


def http_client(**kw: Any) -> httpx.Client:
    """An `httpx.Client` for a test server (every test client is made here, with `TLS`)."""
    kw.setdefault("verify", TLS)
    return httpx.Client(**kw)


# The name the test model is served under (every test server's default model).
MODEL = "tiny"
# Options for a server that loads no server extension but LMSP: the venv enables JupyterLab's
# (which runs `node yarn config` at every start), jupyter-lsp's, the terminals' and
# notebook_shim's, about 0.9 s of CPU per start here, and a test server only speaks the LMSP API
# (and runs kernels, which are Jupyter Server's own). Every `ServerProcess` starts with them; the
# browser tests' JupyterLab is `labserver.LabServer`.
ONLY_LMSP = [
    f"--ServerApp.jpserver_extensions={name}=False"
    for name in ("jupyterlab", "jupyter_lsp", "jupyter_server_terminals", "notebook_shim")
]


def with_test_model(data_dir: Path, test_model_dir: Path) -> Path:
    """`data_dir`, with the test model linked into its model folder as `MODEL`."""
    (data_dir / "models").mkdir(exist_ok=True)
    (data_dir / "models" / MODEL).symlink_to(test_model_dir)
    return data_dir


class ServerProcess(LMSPServerProcess):
    """Extra keyword arguments become `--LMSPExtension.<name>=<value>` options; `env` is added
    to the server's environment, `options` to its command line (after `ONLY_LMSP`, so a test
    may enable an extension again). Several servers on one data
    folder are told apart by `name` (their logs and runtime folders)."""

    # A cold start (the worker imports MLX and loads the model) is slow on a loaded CI machine.
    start_timeout = 180.0

    def __init__(
        self,
        data_dir: Path,
        *,
        default_model: str = MODEL,
        env: dict[str, str] | None = None,
        options: list[str] | None = None,
        name: str | None = None,
        **traits: Any,
    ) -> None:
        super().__init__(
            data_dir,
            token=TOKEN,
            default_model=default_model,
            traits=traits,
            env=env,
            options=[*ONLY_LMSP, *(options or ())],
            log_path=Path(data_dir) / f"server-{name}.log" if name else None,
            runtime_dir=Path(data_dir) / f"runtime-{name}" if name else None,
        )

    @property
    def url(self) -> str:
        return self.origin

    def client(self, **kw: Any) -> httpx.Client:
        # Generous: a request may wait behind model loads and grammar compiles, many times
        # slower on a loaded machine (issue 43: make test passes beside a CPU hog). A test that
        # needs a short timeout passes its own.
        kw.setdefault("timeout", 120)
        return http_client(base_url=self.api, headers=self.headers, **kw)
