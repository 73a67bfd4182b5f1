"""Model downloads as registration tasks (issue 39): `POST /models {"source": "hf://ORG/NAME"}`
against a hub the test serves on loopback (tests/loopbackhub.py, `HF_ENDPOINT`), through a real
`jupyter server` subprocess and the real `huggingface_hub` client. Nothing is fetched from
outside.

Shown here: a download killed with SIGKILL about half way finishes after a restart without
fetching again what was on disk (the hub counts what it served), with the right digest, and the
model then answers; a file whose bytes differ from the hash the hub publishes fails the task
(`download_corrupt`) and registers nothing; a cancel stops a download.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from bigmodel import GATE, SHARD1, SHARD2, MiB, write_big_model
from inprocess_cli import run_cli
from loopbackhub import SEND, LoopbackHub
from serverproc import ServerProcess, with_test_model

from jupyter_lmsp.models.digests import file_digests, model_digest
from jupyter_lmsp.protocol.events import TaskProgressEvent

# Every test runs on the module's server subprocess (`site`).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def big_model(tmp_path_factory: pytest.TempPathFactory, test_model_dir: Path) -> Path:
    """The test llama with wide MLP layers (tests/bigmodel.py): big enough that a download has
    a middle to be killed in."""
    return write_big_model(tmp_path_factory.mktemp("big") / "big", test_model_dir)


@pytest.fixture(scope="module")
def hub(big_model: Path, test_model_dir: Path):
    repos = {
        "lmsp-test/big": big_model,
        "lmsp-test/slow": big_model,
        "lmsp-test/bad": test_model_dir,
        "lmsp-test/huge": test_model_dir,
        "lmsp-test/small": test_model_dir,
    }
    with LoopbackHub(repos) as served:
        yield served


class Site:
    """A data folder, a Hugging Face home, and the one server process running on them."""

    def __init__(self, root: Path, test_model_dir: Path, hub: LoopbackHub) -> None:
        self.data = root / "data"
        self.data.mkdir()
        with_test_model(self.data, test_model_dir)
        self.cache = root / "hf-home" / "hub"
        self.env = hub.client_env(root / "hf-home")
        self.server = ServerProcess(self.data, env=self.env).start()

    def restart_after_kill(self) -> None:
        self.server.kill()
        self.server = ServerProcess(self.data, env=self.env).start()


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory, test_model_dir: Path, hub: LoopbackHub):
    here = Site(tmp_path_factory.mktemp("downloads"), test_model_dir, hub)
    yield here
    here.server.stop()


def task_log(client, task_id):
    r = client.get(f"/tasks/{task_id}/events", params={"limit": 1000})
    assert r.status_code == 200, r.text
    return r.json()["data"]


def wait_until(predicate, what, timeout=240.0):
    """Poll `predicate` until it is true; `timeout` only bounds a hung test."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"never happened: {what}")


def finished(client, task_id):
    def ended():
        task = client.get(f"/tasks/{task_id}").json()
        return task if task["state"] in ("completed", "failed", "cancelled") else None

    return wait_until(ended, f"task {task_id} ends")


def wait_gate(hub: LoopbackHub) -> None:
    assert hub.gate_reached.wait(240), "the download never reached the hub's gate"


def open_gate(hub: LoopbackHub) -> None:
    hub.gate = None
    hub.release.set()


def test_corrupt_file_fails_the_task_and_registers_nothing(site, hub, test_model_dir):
    hub.corrupt.add(("lmsp-test/bad", "model.safetensors"))
    with site.server.client() as c:
        r = c.post("/models", json={"source": "hf://lmsp-test/bad"})
        assert r.status_code == 202, r.text
        task = finished(c, r.json()["id"])
        assert task["state"] == "failed"
        assert task["error"]["code"] == "download_corrupt"
        assert "model.safetensors" in task["error"]["message"]
        assert c.get("/models/bad").status_code == 404
        types = [e["type"] for e in task_log(c, task["id"])]
        assert "task.progress" in types and types[-1] == "task.failed"
    # The bad bytes left the cache (no retry nor other tool reuses them); the good files stay.
    repo = site.cache / "models--lmsp-test--bad"
    published = file_digests(test_model_dir)
    blobs = {p.name for p in (repo / "blobs").iterdir()}
    weights_sha = next(f["sha256"] for f in published if f["path"] == "model.safetensors")
    assert weights_sha not in blobs
    snapshot = next((repo / "snapshots").iterdir())
    assert not (snapshot / "model.safetensors").exists()
    assert (snapshot / "config.json").is_file()


def test_cancel_stops_a_download(site, hub):
    hub.close_gate("lmsp-test/slow", SHARD2, MiB)
    try:
        with site.server.client() as c:
            r = c.post("/models", json={"source": "hf://lmsp-test/slow"})
            assert r.status_code == 202, r.text
            task_id = r.json()["id"]
            wait_gate(hub)
            assert c.get(f"/tasks/{task_id}").json()["state"] == "running"
            assert c.post(f"/tasks/{task_id}/cancel").status_code == 200
            task = finished(c, task_id)
            assert task["state"] == "cancelled"
            assert c.get("/models/slow").status_code == 404
    finally:
        open_gate(hub)
    # The hub sent no more than up to its gate: the download process was stopped there.
    assert hub.served[("lmsp-test/slow", SHARD2)] <= MiB


def test_download_killed_half_way_resumes_after_restart(site, hub, big_model):
    repo = "lmsp-test/big"
    size = hub.size(repo)
    shard1 = (big_model / SHARD1).stat().st_size
    blobs = site.cache / "models--lmsp-test--big" / "blobs"
    hub.close_gate(repo, SHARD2, GATE)
    try:
        with site.server.client() as c:
            r = c.post("/models", json={"source": f"hf://{repo}@main"})
            assert r.status_code == 202, r.text
            task_id = r.json()["id"]
            wait_gate(hub)

            def on_disk() -> int:
                parts = list(blobs.glob("*.incomplete"))
                return parts[0].stat().st_size if parts else 0

            # What the hub sent up to its gate, as far as it reached the disk.
            kept = wait_until(lambda: on_disk() >= 10 * MiB and on_disk(), "a piece on disk")
            assert 0.4 < (shard1 + kept) / size < 0.6  # killed about half way
        site.restart_after_kill()
    finally:
        open_gate(hub)

    with site.server.client() as c:
        task = finished(c, task_id)
        assert task["state"] == "completed", task
        log = task_log(c, task_id)
        # The retried attempt said first how much it took up from the disk.
        second_run = max(i for i, e in enumerate(log) if e["type"] == "task.running")
        resumed = next(e for e in log[second_run:] if e["type"] == "task.progress")
        assert resumed["stage"] == "downloading" and resumed["bytes_done"] >= shard1 + kept
        assert resumed["bytes_total"] == size and resumed["files_total"] == len(hub.repos[repo])
        last = [e for e in log if e["type"] == "task.progress" and e["stage"] == "downloading"][-1]
        assert last["bytes_done"] == size and last["files_done"] == last["files_total"]
        # Every progress event has every field the OpenAPI document lists (a download's are
        # null while hashing), so the sidebar's generated types hold.
        required = set(TaskProgressEvent.model_json_schema(mode="serialization")["required"])
        progress = [e for e in log if e["type"] == "task.progress"]
        assert {e["stage"] for e in progress} == {"downloading", "hashing"}
        assert all(required <= set(e) for e in progress), progress

        assert log[-1]["type"] == "task.completed"
        model = log[-1]["result"]["model"]
        expected = file_digests(big_model)
        assert model["files"] == expected and model["digest"] == model_digest(expected)
        assert model["source"].startswith(f"hf://{repo}@")
        assert c.get("/models/big").json()["digest"] == model_digest(expected)

        r = c.post(
            "/responses",
            json={"model": "big", "input": "hi", "max_output_tokens": 3, "temperature": 0},
        )
        assert r.status_code == 200, r.text
        assert r.json()["status"] in ("completed", "incomplete") and r.json()["output"]

    # The first shard was fetched once; the second was taken up at the bytes on disk, with a
    # Range request. So the hub served the whole model once, plus what it had sent past the
    # kept piece before the kill (GATE - kept) and the one piece (SEND) its thread wrote into
    # the dead connection when the gate opened after the kill.
    assert hub.starts[(repo, SHARD1)] == [0]
    assert hub.starts[(repo, SHARD2)] == [0, kept]
    served = hub.total_served(repo)
    assert served <= size + (GATE - kept) + SEND
    assert served < 1.5 * size
    # The partial file became the blob; no `.incomplete` is left behind.
    assert not list(blobs.glob("*.incomplete"))


def test_hub_sources_that_are_refused(site):
    with site.server.client() as c:
        r = c.post("/models", json={"source": "hf://not a repo"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_source"
        r = c.post("/models", json={"source": "hf://lmsp-test/absent"})
        assert r.status_code == 202
        task = finished(c, r.json()["id"])
        assert task["state"] == "failed" and task["error"]["code"] == "model_not_found"


def test_a_repo_over_the_size_limit_is_refused_before_any_byte(site, hub, tmp_path):
    """The registration process itself (as the server runs it), with a limit below the size
    the hub lists."""
    import os

    command = [sys.executable, "-m", "jupyter_lmsp.models.register", "hf://lmsp-test/huge"]
    command += ["--model-dir", str(tmp_path), "--id", "huge", "--max-bytes", "1000"]
    run = subprocess.run(
        command,
        env={**os.environ, **site.env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    last = json.loads(run.stdout.strip().splitlines()[-1])
    assert last["error"]["code"] == "model_too_large", run.stdout + run.stderr
    assert str(hub.size("lmsp-test/huge")) in last["error"]["message"]
    assert hub.total_served("lmsp-test/huge") == 0


def test_cli_pull(site, test_model_dir, capsys):
    """`jupyter lmsp models pull` against the running server: progress on stderr, the model
    and its digest on stdout."""
    common = ["--url", site.server.origin, "--token", site.server.token]
    assert run_cli(["models", "pull", "hf://lmsp-test/small", "--id", "small-pulled", *common]) == 0
    out, err = capsys.readouterr()
    digest = model_digest(file_digests(test_model_dir))
    assert out.strip() == f"small-pulled: available  {digest}"
    assert "downloading" in err and "files" in err
    assert run_cli(["models", "pull", "hf://lmsp-test/small", "--id", "small-pulled", *common]) == 1
    assert "model_exists" in capsys.readouterr().err
