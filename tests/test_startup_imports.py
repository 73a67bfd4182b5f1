"""What a server imports to start: not the inference worker, numpy or SQLAlchemy's PostgreSQL
dialect, which only the worker process, embeddings, grammar checks and a PostgreSQL database
need (each costs a SQLite server's start tens of milliseconds of CPU)."""

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
print(json.dumps(sorted(sys.modules)))
"""


@pytest.fixture(scope="module")
def modules() -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True
    ).stdout
    return set(json.loads(out))


def test_the_extension_loads(modules):
    assert "jupyter_lmsp.extension" in modules
    assert "jupyter_lmsp.engine.client" in modules


@pytest.mark.parametrize("name", NOT_AT_START)
def test_the_server_does_not_import(modules, name):
    assert not any(m == name or m.startswith(name + ".") for m in modules)
