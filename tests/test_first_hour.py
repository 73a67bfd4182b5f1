"""A newcomer's first hour (issue 40), scripted: the token `make serve` keeps is the same at
every start (a server given it in `JUPYTER_TOKEN` takes it and only it), and a Jupyter server started with no LMSP flag at all (no default model, no data
folder, no token option: as `make serve` and a plain `.venv/bin/jupyter lab` start it) answers
the README's first question with the demo model.

The server runs with `JUPYTER_DATA_DIR` pointing into the test's folder, so the extension's
default data folder, the demo model's default place and the kept token's file are all there,
found by the same defaults a user's machine uses.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from jupyter_lmsp.auth.servertoken import TOKEN_FILE
from jupyter_lmsp.client.sandbox import LMSPServerProcess
from jupyter_lmsp.models.demo import DEMO_MODEL_ID

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def kept_token(env: dict[str, str], *args: str) -> str:
    """What `make serve` runs: `python -m jupyter_lmsp.auth.servertoken`."""
    done = subprocess.run(
        [sys.executable, "-m", "jupyter_lmsp.auth.servertoken", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stdout.strip()


class PlainServer(LMSPServerProcess):
    """`jupyter server` with the token in `JUPYTER_TOKEN` (as `make serve` gives it) and no
    `--LMSPExtension` option: the data folder is the default one under `JUPYTER_DATA_DIR`."""

    def __init__(self, jupyter_data: Path, token: str) -> None:
        super().__init__(jupyter_data / "lmsp", token=token, runtime_dir=jupyter_data / "rt")
        self.jupyter_data = jupyter_data

    def command(self) -> list[str]:
        return [
            arg
            for arg in super().command()
            if not arg.startswith(("--IdentityProvider.token=", "--LMSPExtension."))
        ]

    def environment(self) -> dict[str, str]:
        return {
            **super().environment(),
            "JUPYTER_DATA_DIR": str(self.jupyter_data),
            "JUPYTER_TOKEN": self.token,
        }


def test_the_kept_token_lasts_and_a_server_without_flags_answers_with_the_demo_model(
    tmp_path: Path, demo_model_dir: Path
) -> None:
    jupyter_data = tmp_path / "jupyter-data"
    env = {**os.environ, "JUPYTER_DATA_DIR": str(jupyter_data), "JUPYTER_PLATFORM_DIRS": "1"}
    token = kept_token(env)
    token_file = jupyter_data / "lmsp" / TOKEN_FILE
    assert kept_token(env, "--path") == str(token_file)
    assert len(token) >= 40 and token_file.read_text().strip() == token
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert kept_token(env) == token  # the next `make serve` gets the same one

    # The demo model where `make serve` converts it (the default model folder).
    models = jupyter_data / "lmsp" / "models"
    models.mkdir(parents=True)
    (models / DEMO_MODEL_ID).symlink_to(demo_model_dir)

    server = PlainServer(jupyter_data, token)
    assert not any(a.startswith("--LMSPExtension.") for a in server.command())
    with server.start():
        service = httpx.get(f"{server.api}/service", headers=server.headers, timeout=30).json()
        assert service["default_model"] == DEMO_MODEL_ID
        # The README's first question, as it asks it: no model, temperature 0.
        with openai.OpenAI(base_url=server.api, api_key=token) as client:
            answer = client.responses.create(
                input="What is the capital of France?", temperature=0, max_output_tokens=24
            )
        assert answer.model == DEMO_MODEL_ID and "Paris" in answer.output_text
        # Only the kept token opens it; the next start (same file, same token) is the same.
        wrong = httpx.get(f"{server.api}/service", headers={"Authorization": "token nope"})
        assert wrong.status_code == 401


def test_the_default_model_is_configured_else_the_demo_model_else_the_first_registered(
    tmp_path: Path, test_model_dir: Path
) -> None:
    import time

    from jupyter_lmsp.services.catalog import ModelCatalog
    from jupyter_lmsp.store import Database
    from jupyter_lmsp.store import models as store
    from jupyter_lmsp.store.database import sqlite_url
    from jupyter_lmsp.store.tables import Model

    db = Database(sqlite_url(tmp_path / "lmsp.sqlite"))

    def register(model_id: str, path: Path = test_model_dir) -> None:
        store.save_model(
            db, Model(id=model_id, format="mlx", path=str(path), created_at=time.time())
        )

    def default(configured: str | None = None) -> str | None:
        return ModelCatalog(db, tmp_path / "models", configured).default()

    assert default() is None
    register("first")
    register("second")
    assert default() == "first"  # the model registered first
    register(DEMO_MODEL_ID)
    assert default() == DEMO_MODEL_ID  # the demo model once it is there
    assert default("second") == "second"  # a configured one wins
    register("gone", tmp_path / "nowhere")
    store.delete_model(db, DEMO_MODEL_ID)
    store.delete_model(db, "first")
    assert default() == "second"  # never a model whose files are missing
    db.dispose()
