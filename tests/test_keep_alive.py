"""`keep_alive` per request on generation (issue 39), through a real `jupyter server` and its
real inference worker: an LMSP extension field of `POST /responses` and `POST
/chat/completions`, as Ollama's, stored in the task's params.

- `keep_alive: 0` unloads the model once the response is done, on a server whose own
  keep-alive (300 s) would keep it: `GET /models` shows it `available` again;
- `keep_alive: -1` keeps a model loaded past the server's keep-alive: on a server whose
  keep-alive is one second, a second model used *after* it, without the field, is unloaded for
  idleness while the first stays loaded;
- the value is stored in the task's params: a response whose server was killed mid-generation
  still unloads its model when the next server has finished it;
- anything but a number is a 400 naming `keep_alive`.

Nothing here is timed: the tests wait for states the server reports.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from serverproc import MODEL, ServerProcess, with_test_model

from jupyter_lmsp.models.testmodel import make_test_model
from jupyter_lmsp.protocol.params import TaskParams
from jupyter_lmsp.services.generation import Generation

# Every test starts server subprocesses.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

OTHER = "other"


def start(root: Path, test_model_dir: Path, **traits: Any) -> ServerProcess:
    data = with_test_model(root, test_model_dir)
    make_test_model(data / "models" / OTHER, seed=1)
    return ServerProcess(data, **traits).start()


@pytest.fixture(scope="module")
def patient(tmp_path_factory: pytest.TempPathFactory, test_model_dir: Path) -> Iterator[Any]:
    """A server that keeps an idle model for its default 300 s."""
    server = start(tmp_path_factory.mktemp("patient"), test_model_dir)
    yield server
    server.stop()


def state(client: httpx.Client, model: str) -> str:
    r = client.get(f"/models/{model}")
    assert r.status_code == 200, r.text
    return str(r.json()["state"])


def wait_for_state(client: httpx.Client, model: str, wanted: str) -> None:
    """Poll the model's state; the deadline only bounds a hung test."""
    deadline = time.monotonic() + 120
    while state(client, model) != wanted:
        assert time.monotonic() < deadline, f"{model} never became {wanted}"
        time.sleep(0.05)


def respond(client: httpx.Client, model: str, **extra: Any) -> dict[str, Any]:
    body = {"model": model, "input": "hi", "max_output_tokens": 3, "temperature": 0, **extra}
    r = client.post("/responses", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["status"] in ("completed", "incomplete")
    return dict(r.json())


def test_keep_alive_zero_unloads_the_model_when_the_response_is_done(patient: Any) -> None:
    with patient.client() as c:
        respond(c, MODEL)
        # Without the field, the server's 300 s keep it loaded.
        assert state(c, MODEL) == "loaded"
        done = respond(c, MODEL, keep_alive=0)
        wait_for_state(c, MODEL, "available")
        # The chat completions API takes it too.
        r = c.post(
            "/chat/completions",
            json={
                "model": OTHER,
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 3,
                "keep_alive": 0,
            },
        )
        assert r.status_code == 200, r.text
        wait_for_state(c, OTHER, "available")
        task = c.get(f"/tasks/{done['task_id']}").json()
        assert task["state"] == "completed"


def test_the_stored_params_carry_keep_alive_to_the_job(patient: Any) -> None:
    """What the worker's job is built from when a task is run: its params as stored
    (`Generation.from_params` feeds `job_for`)."""
    from storehelpers import open_db

    from jupyter_lmsp.store import queries

    with patient.client() as c:
        done = respond(c, MODEL, keep_alive=-1)
        absent = respond(c, MODEL)
    db = open_db(patient.data_dir)
    try:
        for response, expected in ((done, -1.0), (absent, None)):
            task = queries.get_task(db, response["task_id"])
            assert task is not None
            generation = Generation.from_params(TaskParams.load(task.params))
            assert generation.keep_alive == expected
    finally:
        db.dispose()


def test_keep_alive_survives_a_restart(
    tmp_path_factory: pytest.TempPathFactory, test_model_dir: Path
) -> None:
    """A background response with `keep_alive: 0`, its server killed mid-generation, is taken
    up by the next server (`on_restart: resume`) and, once done, its model is unloaded, though
    that server's keep-alive is 300 s: the new job had the stored value."""
    root = tmp_path_factory.mktemp("restart")
    # Slow tokens (200 of them, ~10 s), so the kill comes mid-generation even on a loaded
    # machine; frequent snapshots to resume from.
    server = start(root, test_model_dir, engine_token_delay=0.05, snapshot_interval=0.02)
    try:
        with server.client() as c:
            r = c.post(
                "/responses",
                json={
                    "input": "Tell me a story about a robot.",
                    "background": True,
                    "max_output_tokens": 200,
                    "temperature": 0,
                    "on_restart": "resume",
                    "keep_alive": 0,
                },
            )
            assert r.status_code == 202, r.text
            task_id = r.json()["task_id"]
            deadline = time.monotonic() + 120
            while c.get(f"/tasks/{task_id}").json()["last_sequence_number"] < 10:
                assert time.monotonic() < deadline, "the response never got going"
                time.sleep(0.05)
    finally:
        server.kill()
    server = ServerProcess(root).start()
    try:
        with server.client() as c:
            deadline = time.monotonic() + 120
            while (task := c.get(f"/tasks/{task_id}").json())["state"] != "completed":
                assert task["state"] not in ("failed", "cancelled"), task
                assert time.monotonic() < deadline, task
                time.sleep(0.05)
            # Taken up once after the kill (the first run counts none).
            assert task["attempts"] == 1, task
            wait_for_state(c, MODEL, "available")
    finally:
        server.stop()


@pytest.mark.parametrize("value", ["forever", None, [1], {"s": 1}, True])
def test_a_bad_keep_alive_is_a_400_naming_the_field(patient: Any, value: Any) -> None:
    with patient.client() as c:
        for path, body in (
            ("/responses", {"input": "hi"}),
            ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ):
            r = c.post(path, json={**body, "keep_alive": value})
            if value is None:
                # null is the field absent (the server's keep-alive).
                assert r.status_code == 200, r.text
                continue
            assert r.status_code == 400, (path, value, r.text)
            assert r.json()["error"]["param"] == "keep_alive", r.text


def test_keep_alive_minus_one_keeps_the_model_past_the_servers(
    tmp_path_factory: pytest.TempPathFactory, test_model_dir: Path
) -> None:
    server = start(tmp_path_factory.mktemp("hasty"), test_model_dir, keep_alive=1.0)
    try:
        with server.client() as c:
            respond(c, MODEL, keep_alive=-1)
            # Used after it, with the server's keep-alive: idle for longer than 1 s once
            # unloaded, as the first is by then.
            respond(c, OTHER)
            wait_for_state(c, OTHER, "available")
            assert state(c, MODEL) == "loaded"
    finally:
        server.stop()
