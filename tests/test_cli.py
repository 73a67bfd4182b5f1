"""`jupyter lmsp …` reads the server's configuration and acts on its database: a data folder set
only in a Jupyter config file (as the server would read it) is the one every subcommand uses,
and each subcommand (`tasks`, `pair list|approve|deny`, `clients list|revoke`, `purge`,
`models import-demo`) works there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from storehelpers import make_task

from jupyter_lmsp.protocol.pairing import StartPairingRequest
from jupyter_lmsp.services import pairing
from jupyter_lmsp.store import Database
from jupyter_lmsp.store.database import sqlite_url

pytestmark = pytest.mark.timeout(300)


# The installed command's script: `jupyter lmsp` finds it on PATH and runs it, in a second
# Python process (~0.25 s of CPU), which only the first test goes through.
SCRIPT = Path(sys.executable).parent / "jupyter-lmsp"


def jupyter_lmsp(
    config_dir: Path, *args: str, through_jupyter: bool = False
) -> subprocess.CompletedProcess[str]:
    """The installed `jupyter lmsp` command, with `config_dir` as Jupyter's config folder."""
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(config_dir), "JUPYTER_PLATFORM_DIRS": "1"}
    command = [sys.executable, "-m", "jupyter", "lmsp"] if through_jupyter else [str(SCRIPT)]
    return subprocess.run(
        [*command, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def configured(tmp_path: Path) -> tuple[Path, Database]:
    """A Jupyter config folder whose jupyter_server_config.json puts the data folder where
    no default would find it, and that database."""
    data = tmp_path / "somewhere" / "else"
    config = tmp_path / "config"
    config.mkdir()
    (config / "jupyter_server_config.json").write_text(
        json.dumps({"LMSPExtension": {"data_dir": str(data)}})
    )
    return config, Database(sqlite_url(data / "lmsp.sqlite"))


def start_pairing(db: Database, name: str, scopes: list[str]) -> dict:
    return pairing.start(db, StartPairingRequest(client_name=name, scopes=scopes))


def test_every_subcommand_acts_on_the_configured_database(configured):
    config, db = configured
    task_id = make_task(db, "completed")
    a = start_pairing(db, "approved-app", ["tasks:read", "responses:read"])
    d = start_pairing(db, "denied-app", ["tasks:read"])

    listed = jupyter_lmsp(config, "tasks", through_jupyter=True)
    assert listed.returncode == 0, listed.stderr
    assert task_id in listed.stdout
    queued = jupyter_lmsp(config, "tasks", "--state=queued", "--state=running", "--limit=5")
    assert queued.returncode == 0 and task_id not in queued.stdout

    pending = jupyter_lmsp(config, "pair", "list")
    assert pending.returncode == 0, pending.stderr
    assert a["user_code"] in pending.stdout and d["user_code"] in pending.stdout

    # Options before the subcommand, as the command line always allowed.
    approved = jupyter_lmsp(
        config, "--log-level=WARN", "pair", "approve", a["user_code"], "--scopes=tasks:read"
    )
    assert approved.returncode == 0, approved.stderr
    assert approved.stdout.startswith("approved: approved-app (tasks:read)")
    denied = jupyter_lmsp(config, "pair", "deny", d["id"])
    assert denied.returncode == 0 and denied.stdout.startswith("denied")
    again = jupyter_lmsp(config, "pair", "deny", d["id"])
    assert again.returncode == 1 and "already denied" in again.stderr

    token = pairing.poll(db, a["id"], _token_request(a))
    clients = jupyter_lmsp(config, "clients", "list")
    assert clients.returncode == 0 and token["client_id"] in clients.stdout
    revoked = jupyter_lmsp(config, "clients", "revoke", token["client_id"])
    assert revoked.returncode == 0 and revoked.stdout.startswith("revoked")
    assert pairing.authenticate(db, token["access_token"]) is None

    # The server's retention period (from the same configuration) applies.
    kept = jupyter_lmsp(config, "purge")
    assert kept.returncode == 0 and kept.stdout.startswith("purged 0 task(s)")
    time.sleep(0.01)
    purged = jupyter_lmsp(config, "purge", "--retention-seconds=0")
    assert purged.returncode == 0 and purged.stdout.startswith("purged 1 task(s)")


def _token_request(started: dict):
    from jupyter_lmsp.protocol.pairing import PairingTokenRequest

    return PairingTokenRequest(device_code=started["device_code"])


def test_the_command_line_overrides_the_files(configured, tmp_path):
    config, _ = configured
    other = tmp_path / "other"
    make_task(Database(sqlite_url(other / "lmsp.sqlite")), "completed")
    with_option = jupyter_lmsp(config, "tasks", f"--data-dir={other}")
    assert with_option.returncode == 0 and "task_" in with_option.stdout
    from_file = jupyter_lmsp(config, "tasks")
    assert from_file.returncode == 0 and "task_" not in from_file.stdout


def test_bad_input_is_an_error_not_a_traceback(configured):
    config, _ = configured
    unknown_scope = jupyter_lmsp(config, "pair", "approve", "WXYZ-BCDF", "--scopes=root")
    assert unknown_scope.returncode == 1
    assert "Unknown scope(s): root" in unknown_scope.stderr
    assert "Traceback" not in unknown_scope.stderr
    missing = jupyter_lmsp(config, "pair", "approve")
    assert missing.returncode == 2 and "CODE" in missing.stderr
    bare = jupyter_lmsp(config, "pair")
    assert bare.returncode == 2 and "approve" in bare.stdout


def test_import_demo_uses_the_configured_model_folder(configured, demo_gguf):
    config, _ = configured
    data = json.loads((config / "jupyter_server_config.json").read_text())["LMSPExtension"]
    result = jupyter_lmsp(config, "models", "import-demo")
    assert result.returncode == 0, result.stderr
    made = Path(data["data_dir"]) / "models"
    assert result.stdout.startswith("demo model ready: ")
    assert Path(result.stdout.split(": ", 1)[1].strip()).parent == made


def test_the_commands_work_on_postgresql_and_the_file_ones_say_they_cannot(configured, pg_url):
    config, _ = configured
    db = Database(pg_url)
    try:
        tid = make_task(db, "queued")
    finally:
        db.dispose()
    listed = jupyter_lmsp(config, "tasks", f"--db-url={pg_url}")
    assert listed.returncode == 0, listed.stderr
    assert tid in listed.stdout
    backup = jupyter_lmsp(config, "backup", str(config / "copy.sqlite"), f"--db-url={pg_url}")
    assert backup.returncode == 1
    assert "pg_dump" in backup.stderr and "Traceback" not in backup.stderr


def test_a_wrong_folder_is_an_error_naming_the_database_and_creates_nothing(configured, tmp_path):
    config, _ = configured
    wrong = tmp_path / "typo"
    missing = jupyter_lmsp(config, "tasks", f"--data-dir={wrong}")
    assert missing.returncode == 1 and "Traceback" not in missing.stderr
    assert f"no database at {wrong / 'lmsp.sqlite'}" in missing.stderr
    assert not wrong.exists()
    created = jupyter_lmsp(config, "tasks", f"--data-dir={wrong}", "--create")
    assert created.returncode == 0, created.stderr
    assert (wrong / "lmsp.sqlite").is_file()
    # Every command that opens the database says which one.
    assert f"database: {wrong / 'lmsp.sqlite'}" in created.stderr


def test_help_texts_name_jupyter_lmsp():
    from jupyter_lmsp import cli

    for command, word in (
        (cli.PairCommand, "pair"),
        (cli.ClientsCommand, "clients"),
        (cli.ModelsCommand, "models"),
        (cli.LMSPApp, ""),
    ):
        shown = "\n".join(command().emit_help())
        prefix = f"jupyter lmsp {word}".strip()
        assert f"`{prefix} cmd [args]`" in shown and f"`{prefix} cmd -h`" in shown
        assert "`jupyter cmd" not in shown and "jupyter-lmsp" not in shown


def test_models_list_shows_the_models_and_the_default(configured, test_model_dir):
    config, db = configured
    data = json.loads((config / "jupyter_server_config.json").read_text())["LMSPExtension"]
    from jupyter_lmsp.services.catalog import ModelCatalog

    (Path(data["data_dir"]) / "models").mkdir()
    (Path(data["data_dir"]) / "models" / "tiny").symlink_to(test_model_dir)
    assert ModelCatalog(db, Path(data["data_dir"]) / "models", None).sync_model_dir() == ["tiny"]
    listed = jupyter_lmsp(config, "models", "list")
    assert listed.returncode == 0, listed.stderr
    [line] = listed.stdout.splitlines()
    # The only model is the default one, with no default_model configured.
    assert line.split()[:2] == ["tiny", "available"] and line.endswith("(default)")
    assert "sha256:" in line
