"""The real Node clients the suite runs (tests/node/: the openai Node SDK and the Codex CLI).

`make node-clients` (a prerequisite of `make test`) installs them with `npm ci` from
tests/node/package-lock.json, when node_modules is missing or older than the lock. A test that
needs them calls `require_node_clients()`: without Node or without the installed packages (or
with packages other than the lock's) it skips, and fails when `CI` is set
(tests/prerequisites.py). `LMSP_TEST_NODE_DIR` points the tests at another npm folder.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

from prerequisites import require

NODE_DIR = Path(os.environ.get("LMSP_TEST_NODE_DIR") or Path(__file__).parent / "node")
PACKAGES = ("openai", "@openai/codex")


def installed_version(package: str, node_dir: Path = NODE_DIR) -> str | None:
    manifest = node_dir / "node_modules" / package / "package.json"
    try:
        return str(json.loads(manifest.read_text())["version"])
    except (OSError, ValueError, KeyError):
        return None


def locked_version(package: str, node_dir: Path = NODE_DIR) -> str | None:
    try:
        lock = json.loads((node_dir / "package-lock.json").read_text())
        return str(lock["packages"][f"node_modules/{package}"]["version"])
    except (OSError, ValueError, KeyError):
        return None


def require_node_clients() -> Path:
    """The npm folder, once Node and the locked packages are there (else skip, or fail in CI)."""
    node = shutil.which("node")
    require(node, "node (Node.js 20 or later), for the real-client tests")
    require((NODE_DIR / "package-lock.json").exists(), f"{NODE_DIR}/package-lock.json")
    for package in PACKAGES:
        have, want = installed_version(package), locked_version(package)
        require(
            have is not None and have == want,
            f"{package} {want} installed in {NODE_DIR}/node_modules (found "
            f"{have or 'none'}): `make node-clients`",
        )
    return NODE_DIR


def codex_binary(node_dir: Path = NODE_DIR) -> Path:
    """The Codex CLI's launcher, checked to run here (it starts the platform's native binary,
    an optional dependency npm installs only for this platform)."""
    codex = node_dir / "node_modules" / ".bin" / "codex"
    ran = (
        subprocess.run([codex, "--version"], capture_output=True, text=True, timeout=60)
        if codex.exists()
        else None
    )
    require(
        ran is not None and ran.returncode == 0,
        f"a Codex CLI that runs here ({codex} --version: "
        f"{(ran.stderr or ran.stdout).strip()[-300:] if ran else 'missing'})",
    )
    return codex
