"""Finding the Jupyter server to talk to: explicit, from the environment, or from inside a kernel.

In order:
1. an explicit URL (and token) passed by the caller;
2. `LMSP_URL` and `LMSP_TOKEN` in the environment (a server URL, or its `…/lmsp/v1` API URL);
3. the runtime files of running Jupyter servers (`jpserver-<pid>.json`, read with
   `jupyter_server.serverapp.list_running_servers`), which hold each server's URL and token.
   A kernel started by a Jupyter server has that server as its parent process (jupyter_client
   also puts its pid in `JPY_PARENT_PID`), so the server whose pid is the kernel's parent (or
   an ancestor) is the one the kernel belongs to. The kernel's connection file lives in the
   same runtime folder, which is searched as well.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ServerNotFoundError

API_SUFFIX = "lmsp/v1"


@dataclass(frozen=True)
class ServerInfo:
    """Where a Jupyter server is and how to authenticate to it."""

    url: str  # the server's URL, base_url included, ending with "/"
    token: str
    source: str  # "explicit", "environment" or "runtime-file"
    pid: int | None = None
    root_dir: str | None = None

    @property
    def api_url(self) -> str:
        return self.url + API_SUFFIX


def normalize_url(url: str) -> str:
    """A server URL ending in "/": `…/lmsp/v1` and a trailing slash are accepted."""
    url = url.strip().rstrip("/")
    if url.endswith("/" + API_SUFFIX):
        url = url[: -len(API_SUFFIX) - 1]
    return url + "/"


def _ancestor_pids(limit: int = 8) -> list[int]:
    """This process's parent, grandparent, … (from /proc where it exists)."""
    pids = []
    pid = os.getppid()
    for _ in range(limit):
        if pid <= 1:
            break
        pids.append(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            # The command name may contain spaces: the fields after its closing ')' are fixed.
            pid = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return pids


def _runtime_dirs() -> list[str]:
    dirs: list[str] = []
    try:
        from jupyter_core.paths import jupyter_runtime_dir

        dirs.append(jupyter_runtime_dir())
    except Exception:
        pass
    try:
        from ipykernel.connect import get_connection_file

        dirs.append(str(Path(get_connection_file()).parent))
    except Exception:
        # Not inside a kernel.
        pass
    seen: list[str] = []
    for d in dirs:
        if d not in seen:
            seen.append(d)
    return seen


def running_servers(runtime_dirs: list[str] | None = None) -> list[dict[str, Any]]:
    """The runtime-file information of every running Jupyter server found."""
    from jupyter_server.serverapp import list_running_servers

    found: dict[int, dict[str, Any]] = {}
    for d in runtime_dirs if runtime_dirs is not None else _runtime_dirs():
        for info in list_running_servers(d):
            if info.get("url") and not info.get("sock"):
                found.setdefault(int(info.get("pid", 0)), info)
    return list(found.values())


def choose_server(servers: list[dict[str, Any]], ancestors: list[int]) -> dict[str, Any] | None:
    """The server this process belongs to: an ancestor by pid, else the only one running."""
    by_pid = {int(s.get("pid", 0)): s for s in servers}
    parent_env = os.environ.get("JPY_PARENT_PID", "")
    candidates = ([int(parent_env)] if parent_env.isdigit() else []) + ancestors
    for pid in candidates:
        if pid in by_pid:
            return by_pid[pid]
    if len(servers) == 1:
        return servers[0]
    return None


def find_server(
    url: str | None = None,
    token: str | None = None,
    *,
    runtime_dirs: list[str] | None = None,
) -> ServerInfo:
    """Where to connect (see the module doc for the order). Raises `ServerNotFoundError`."""
    if url:
        return ServerInfo(normalize_url(url), token or os.environ.get("LMSP_TOKEN", ""), "explicit")
    env_url = os.environ.get("LMSP_URL")
    if env_url:
        return ServerInfo(normalize_url(env_url), os.environ.get("LMSP_TOKEN", ""), "environment")
    servers = running_servers(runtime_dirs)
    chosen = choose_server(servers, _ancestor_pids())
    if chosen is None:
        if not servers:
            raise ServerNotFoundError(
                "No running Jupyter server found. Start one (`make serve`), or pass url= and "
                "token= (or set LMSP_URL and LMSP_TOKEN)."
            )
        urls = ", ".join(s["url"] for s in servers)
        raise ServerNotFoundError(
            f"Several Jupyter servers are running ({urls}) and none is this process's parent; "
            "pass url= and token= (or set LMSP_URL and LMSP_TOKEN)."
        )
    return ServerInfo(
        normalize_url(chosen["url"]),
        chosen.get("token", "") or token or "",
        "runtime-file",
        pid=chosen.get("pid"),
        root_dir=chosen.get("root_dir"),
    )
