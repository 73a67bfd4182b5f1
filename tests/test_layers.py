"""The layers hold (`lint-imports`, the contracts in pyproject.toml's `[tool.importlinter]`),
and the contracts bite: a copy of the package with one import against the layering fails
them."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")

pytestmark = pytest.mark.timeout(300)


def lint(root: Path) -> subprocess.CompletedProcess[str]:
    """`lint-imports` on the package under `root`, with the project's contracts."""
    return subprocess.run(
        [str(LINT_IMPORTS), "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
        cwd=root,
        env={"PYTHONPATH": str(root), "PATH": str(LINT_IMPORTS.parent)},
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_the_package_keeps_its_layers():
    result = lint(ROOT)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "0 broken" in result.stdout


# (module, import line, contract that must break): each is a dependency the layering forbids.
WRONG_IMPORTS = [
    ("protocol/errors.py", "from ..store import queries", "protocol at the bottom"),
    ("store/queries.py", "from ..services import tasks", "protocol at the bottom"),
    ("engine/messages.py", "from ..store import tables", "protocol at the bottom"),
    ("handlers/tasks.py", "from ..store import queries", "handlers reach the database"),
    ("auth/secrets.py", "from ..protocol import errors", "token and code hashing"),
    ("client/api.py", "from ..widgets import TaskWatcher", "the client"),
    ("widgets/state.py", "from ..services import bus", "the widgets use the client"),
]


@pytest.fixture(scope="module")
def copies(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("layers")


@pytest.mark.parametrize(("module", "line", "contract"), WRONG_IMPORTS)
def test_a_wrong_import_breaks_a_contract(copies, module, line, contract):
    root = copies / module.replace("/", "_")
    shutil.copytree(ROOT / "jupyter_lmsp", root / "jupyter_lmsp", ignore=_build_output)
    path = root / "jupyter_lmsp" / module
    source = path.read_text()
    marker = "from __future__ import annotations\n"
    assert marker in source
    path.write_text(source.replace(marker, f"{marker}\n{line}  # noqa\n", 1))
    result = lint(root)
    assert result.returncode != 0, result.stdout[-2000:]
    broken = result.stdout.split("Broken contracts", 1)[-1]
    assert contract in broken, broken[-2000:]


def _build_output(directory: str, names: list[str]) -> list[str]:
    return [n for n in names if n in ("labextension", "__pycache__")]
