"""The example notebooks (`notebooks/*.ipynb`), executed top to bottom by nbclient in a fresh
kernel against a real server running the tiny test model, with assertions on their outputs.

The kernel gets the server through `LMSP_URL` / `LMSP_TOKEN` and the model through
`LMSP_MODEL` (the notebooks' parameters cell reads them). It runs the Python of this test run
(a kernelspec written for the test), not whatever `python3` kernel the machine may have.
Executed copies are saved under `test-artifacts/notebooks/` for inspection.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from typing import Any

import nbformat
import pytest
from nbclient import NotebookClient
from serverproc import TOKEN, ServerProcess, with_test_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
ARTIFACTS = ROOT / "test-artifacts" / "notebooks"
KERNEL = "lmsp-test-python"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
FINISHED = r"(completed|incomplete)"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, test_model_dir: Path):
    data = tmp_path_factory.mktemp("nbserver")
    with_test_model(data, test_model_dir)
    # A short delay per token keeps background tasks running long enough to be watched.
    proc = ServerProcess(data, engine_token_delay=0.01).start()
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Jupyter path holding one kernelspec: this interpreter with ipykernel."""
    root = tmp_path_factory.mktemp("jupyter-path")
    spec = root / "kernels" / KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "Python (lmsp tests)",
                "language": "python",
            }
        )
    )
    return root


def run_notebook(
    name: str, server: ServerProcess, kernel_dir: Path, tmp_path: Path, monkeypatch
) -> Any:
    monkeypatch.setenv("JUPYTER_PATH", str(kernel_dir))
    monkeypatch.setenv("LMSP_URL", server.url)
    monkeypatch.setenv("LMSP_TOKEN", TOKEN)
    monkeypatch.setenv("LMSP_MODEL", "tiny")
    monkeypatch.setenv("LMSP_MAX_TOKENS", "24")
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    client = NotebookClient(
        nb,
        timeout=240,
        kernel_name=KERNEL,
        resources={"metadata": {"path": str(tmp_path)}},
        store_widget_state=True,
    )
    try:
        client.execute()
    finally:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, ARTIFACTS / f"{name}.ipynb")
    return nb


def cell(nb: Any, marker: str) -> Any:
    """The code cell whose source contains `marker`."""
    found = [c for c in nb.cells if c.cell_type == "code" and marker in c.source]
    assert len(found) == 1, f"{len(found)} cells contain {marker!r}"
    return found[0]


def stdout(c: Any) -> str:
    return "".join(o.get("text", "") for o in c.outputs if o.output_type == "stream")


def widget_states(nb: Any) -> list[dict[str, Any]]:
    saved = nb.metadata.get("widgets", {}).get("application/vnd.jupyter.widget-state+json", {})
    return [m["state"] for m in saved.get("state", {}).values()]


def test_quickstart(server, kernel_dir, tmp_path, monkeypatch):
    nb = run_notebook("quickstart", server, kernel_dir, tmp_path, monkeypatch)

    out = stdout(cell(nb, "lmsp = connect()"))
    assert "lmsp/1.0" in out and "models: ['tiny']" in out

    out = stdout(cell(nb, "first = lmsp.create_response"))
    assert re.search(rf"status: {FINISHED}", out)
    assert re.search(r"text: \S", out)

    out = stdout(cell(nb, "lmsp.stream_text("))
    assert int(re.search(r"\[(\d+) pieces\]", out).group(1)) >= 1

    # The background response, left as the last expression, rendered as a TaskWatcher.
    (result,) = [o for o in cell(nb, "job = lmsp.start_response").outputs if "data" in o]
    assert WIDGET_VIEW in result["data"]
    assert result["data"]["text/plain"].startswith("Response(id='resp_")
    model_id = result["data"][WIDGET_VIEW]["model_id"]
    saved = nb.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    watcher = saved[model_id]["state"]
    assert watcher["kind"] == "response" and watcher["model"] == "tiny"
    assert watcher["task_id"].startswith("task_") and watcher["text"]

    out = stdout(cell(nb, "done = job.wait("))
    assert re.search(rf"status: {FINISHED}", out)
    tokens = int(re.search(r"tokens: (\d+)", out).group(1))
    assert 1 <= tokens <= 48

    out = stdout(cell(nb, "events = lmsp.all_events"))
    assert re.search(rf"events: response\.created … response\.{FINISHED}", out)

    out = stdout(cell(nb, "oa = lmsp.openai_client()"))
    assert re.match(rf"{FINISHED} \|", out)


def test_tasks_and_recovery(server, kernel_dir, tmp_path, monkeypatch):
    nb = run_notebook("tasks-and-recovery", server, kernel_dir, tmp_path, monkeypatch)

    out = stdout(cell(nb, "long_job = lmsp.start_response"))
    assert out.count(" queued") == 3

    (board,) = [o for o in cell(nb, "board = TaskBoard(lmsp)").outputs if "data" in o]
    assert WIDGET_VIEW in board["data"]

    out = stdout(cell(nb, 'print("cancel ->"'))
    assert re.search(r"before cancel: (running|queued|loading)", out)
    kept = re.search(r"after: cancelled \| kept (\d+) characters", out)
    assert kept and int(kept.group(1)) > 0

    out = stdout(cell(nb, "for job in short_jobs:"))
    states = re.findall(r"task_\w+ (\w+)", out)
    assert states == ["cancelled", "completed", "completed"]
    assert re.search(r"the board shows \d+ tasks", out)
    cancelled = re.search(r"cancelled tasks on the board: \[(.*)\]", out).group(1)
    assert cancelled.count("task_") == 1

    out = stdout(cell(nb, "sandbox.kill()"))
    assert re.search(r"resume +was running", out)

    out = stdout(cell(nb, "sandbox.start()"))
    assert re.search(rf"resume +running +-> {FINISHED}", out)
    assert re.search(rf"retry +\w+ +-> {FINISHED}", out)
    assert re.search(r"fail +\w+ +-> failed", out)

    out = stdout(cell(nb, "reference = sb.create_response"))
    assert "resume == uninterrupted: True" in out
    assert "server_restarted" in out

    # Both widgets were live in the kernel: their last state was recorded.
    kinds = {s.get("_model_name") for s in widget_states(nb)}
    assert "AnyModel" in kinds
    watchers = [s for s in widget_states(nb) if s.get("state") == "cancelled"]
    assert watchers and watchers[0]["text"]


def _pairing_merged() -> bool:
    return importlib.util.find_spec("jupyter_lmsp.handlers.pairing") is not None


def test_external_clients(server, kernel_dir, tmp_path, monkeypatch):
    nb = run_notebook("external-clients", server, kernel_dir, tmp_path, monkeypatch)

    out = stdout(cell(nb, "oa = lmsp.openai_client()"))
    assert re.search(rf"responses: {FINISHED} \|", out)
    assert re.search(rf"stream: response\.created … response\.{FINISHED}", out)
    assert re.search(r"chat: (stop|length) \|", out)

    out = stdout(cell(nb, "approved = lmsp.approve_pairing"))
    assert "approved: approved" in out
    assert re.search(r"PAIRED client_\w+ responses:read,responses:write", out)
    assert re.search(rf"RESPONSE {FINISHED} ", out)

    out = stdout(cell(nb, "lmsp.revoke_client(client_id)"))
    assert "AFTER REVOKE: AuthenticationError 401" in out
    assert "exit code 0" in out


def test_structured_outputs_and_tools(server, kernel_dir, tmp_path, monkeypatch):
    nb = run_notebook("structured-outputs-and-tools", server, kernel_dir, tmp_path, monkeypatch)

    out = stdout(cell(nb, "parsed = oa.responses.parse("))
    assert "status: completed" in out and "is a City: True" in out
    assert "chat parsed is a City: True" in stdout(cell(nb, "chat = oa.chat.completions.parse("))

    out = stdout(cell(nb, "schema = {"))
    assert "refused: 400 invalid_schema text.format.schema.contains" in out

    out = stdout(cell(nb, "WEATHER_TOOL = {"))
    assert re.search(r"CALL get_weather \{'city': ", out)
    assert re.search(rf"ANSWER {FINISHED} \|", out)
    out = stdout(cell(nb, 'question = {"role": "user"'))
    assert re.search(rf"INPUT LOOP 3 items -> {FINISHED}", out)

    (result,) = [o for o in cell(nb, "watched = lmsp.start_response(").outputs if "data" in o]
    assert WIDGET_VIEW in result["data"]
    assert "WATCHED completed ['get_weather']" in stdout(cell(nb, "done = watched.wait("))
    # The watcher's last state shows the call, complete, with its arguments.
    model_id = result["data"][WIDGET_VIEW]["model_id"]
    saved = nb.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    calls = saved[model_id]["state"]["calls"]
    assert [(c["name"], c["status"]) for c in calls] == [("get_weather", "completed")]
    assert json.loads(calls[0]["arguments"])["city"]
