"""What a server imports to start: not the inference worker, numpy or SQLAlchemy's PostgreSQL
dialect, which only the worker process, embeddings, grammar checks and a PostgreSQL database
need (each costs a SQLite server's start tens of milliseconds of CPU). The extension's module
itself imports only its settings' needs (what `jupyter lmsp` commands use); the services and
the handlers come with `initialize_settings` and `initialize_handlers`, which the script runs
as the server does, on a new data folder."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

NOT_AT_START = ("jupyter_lmsp.engine.worker", "numpy", "sqlalchemy.dialects.postgresql", "mlx")

SCRIPT = """
import gc, json, sys
import jupyter_lmsp
(point,) = jupyter_lmsp._jupyter_server_extension_points()
assert gc.isenabled(), "the collector must be on again after the extension's import"
settings_only = sorted(sys.modules)
extension = point["app"](data_dir=sys.argv[1])
extension.initialize_settings()
extension.initialize_handlers()
assert extension.handlers
print(json.dumps({"settings": settings_only, "server": sorted(sys.modules)}))
"""


@pytest.fixture(scope="module")
def imported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, set[str]]:
    data = tmp_path_factory.mktemp("startup-imports")
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(data)], capture_output=True, text=True, check=True
    ).stdout
    return {k: set(v) for k, v in json.loads(out.splitlines()[-1]).items()}


@pytest.fixture(scope="module")
def modules(imported: dict[str, set[str]]) -> set[str]:
    return imported["server"]


def test_the_extension_loads(modules):
    assert "jupyter_lmsp.extension" in modules
    assert "jupyter_lmsp.engine.client" in modules
    assert "jupyter_lmsp.handlers.routes" in modules


def test_the_settings_alone_leave_the_services_and_handlers_unimported(imported):
    settings = imported["settings"]
    assert "jupyter_lmsp.extension" in settings
    for name in ("jupyter_lmsp.handlers.routes", "jupyter_lmsp.services.runner"):
        assert name not in settings and name in imported["server"]


@pytest.mark.parametrize("name", NOT_AT_START)
def test_the_server_does_not_import(modules, name):
    assert not any(m == name or m.startswith(name + ".") for m in modules)
