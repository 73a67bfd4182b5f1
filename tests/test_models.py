"""The model registry (LMSP B4) in a real Jupyter Server: models found in the model folder,
registration tasks from a local MLX directory, the Hugging Face cache and a GGUF file,
digests, deletion, and corruption detected before a model is loaded."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest
from jpserver import ServerPool
from tornado.httpclient import HTTPClientError

from jupyter_lmsp.models.demo import demo_gguf_path
from jupyter_lmsp.models.digests import file_digests, model_digest

pytest_plugins = ["pytest_jupyter.jupyter_server"]
pytestmark = pytest.mark.timeout(300)


def hugging_face_cache(data_dir, test_model_dir):
    """A Hugging Face cache holding a copy of the test model, as `huggingface_hub` lays it
    out, in `data_dir`."""
    hub = data_dir / "hf-hub"
    snapshot = hub / "models--lmsp-test--tiny-hf" / "snapshots" / "0123abcd"
    shutil.copytree(test_model_dir, snapshot)
    (hub / "models--lmsp-test--tiny-hf" / "refs").mkdir()
    (hub / "models--lmsp-test--tiny-hf" / "refs" / "main").write_text("0123abcd")
    return hub


def models_config(data_dir):
    return {
        "ServerApp": {"jpserver_extensions": {"jupyter_lmsp": True}},
        "LMSPExtension": {
            "data_dir": str(data_dir),
            "default_model": "tiny",
            "use_openblas": "no",
        },
    }


@pytest.fixture(scope="module")
def shared(tmp_path_factory, test_model_dir):
    """One server for the module's tests: each registers its models under ids of its own and
    leaves `tiny` as it found it."""
    with ServerPool(
        tmp_path_factory,
        test_model_dir,
        env=lambda data: {"HF_HUB_CACHE": str(hugging_face_cache(data, test_model_dir))},
    ) as pool:
        yield pool.get(None, models_config)


@pytest.fixture
def jp_fetch(shared):
    client = shared.client()
    yield client.fetch
    client.close()


@pytest.fixture
def lmsp_data(shared):
    return shared.data_dir


async def call(jp_fetch, method, path, body=None, **kw):
    kwargs = {"method": method, **kw}
    if body is not None:
        kwargs["body"] = json.dumps(body)
    try:
        r = await jp_fetch("lmsp", "v1", *path.split("/"), **kwargs)
    except HTTPClientError as e:
        if e.response is None:  # no answer at all (a timeout): say so, not AttributeError
            raise
        return e.code, json.loads(e.response.body)
    return r.code, json.loads(r.body)


async def finished(jp_fetch, task_id, timeout=240):
    for _ in range(int(timeout / 0.1)):
        _, task = await call(jp_fetch, "GET", f"tasks/{task_id}")
        if task["state"] in ("completed", "failed", "cancelled"):
            return task
        await asyncio.sleep(0.1)
    raise AssertionError(task)


async def test_model_folder_is_registered_with_digests(jp_fetch, test_model_dir):
    status, listing = await call(jp_fetch, "GET", "models")
    assert status == 200 and listing["object"] == "list"
    (tiny,) = [m for m in listing["data"] if m["id"] == "tiny"]
    assert tiny["object"] == "model" and tiny["state"] == "available"
    expected = file_digests(test_model_dir)
    assert tiny["files"] == expected
    assert tiny["digest"] == model_digest(expected)
    assert tiny["size_bytes"] == sum(f["size"] for f in expected)
    status, one = await call(jp_fetch, "GET", "models/tiny")
    assert one == tiny


async def test_register_local_dir_then_use_and_delete(jp_fetch, test_model_dir, tmp_path):
    copy = tmp_path / "elsewhere" / "tiny-copy"
    shutil.copytree(test_model_dir, copy)
    status, task = await call(jp_fetch, "POST", "models", {"source": str(copy)})
    assert status == 202 and task["kind"] == "model"
    done = await finished(jp_fetch, task["id"])
    assert done["state"] == "completed", done
    _, page = await call(jp_fetch, "GET", f"tasks/{task['id']}/events")
    types = [e["type"] for e in page["data"]]
    assert types[0] == "task.created" and types[-1] == "task.completed"
    assert "task.running" in types
    registered = page["data"][-1]["result"]["model"]
    assert registered["id"] == "tiny-copy" and registered["path"] == str(copy)
    _, tiny = await call(jp_fetch, "GET", "models/tiny")
    assert registered["digest"] == tiny["digest"]  # the same bytes

    status, resp = await call(
        jp_fetch,
        "POST",
        "responses",
        # Greedy, so it surely runs to the limit (sampling could pick the end token first).
        {"model": "tiny-copy", "input": "hi", "max_output_tokens": 3, "temperature": 0},
    )
    assert status == 200 and resp["model"] == "tiny-copy" and resp["status"] == "incomplete"

    status, again = await call(jp_fetch, "POST", "models", {"source": str(copy)})
    assert status == 409 and again["error"]["code"] == "model_exists"
    status, gone = await call(jp_fetch, "DELETE", "models/tiny-copy")
    assert status == 200 and gone["deleted"] is True
    assert copy.is_dir()  # files the service did not make stay where they are
    status, _ = await call(jp_fetch, "GET", "models/tiny-copy")
    assert status == 404


async def test_register_from_the_hugging_face_cache(jp_fetch):
    status, task = await call(jp_fetch, "POST", "models", {"source": "lmsp-test/tiny-hf"})
    assert status == 202
    assert (await finished(jp_fetch, task["id"]))["state"] == "completed"
    _, model = await call(jp_fetch, "GET", "models/tiny-hf")
    assert model["path"].endswith("snapshots/0123abcd")
    status, missing = await call(jp_fetch, "POST", "models", {"source": "nobody/not-cached"})
    assert status == 404 and missing["error"]["code"] == "model_not_in_cache"


async def test_bad_sources(jp_fetch, tmp_path):
    (tmp_path / "not-a-model").mkdir()
    cases = [
        ({"source": str(tmp_path / "nothing-here")}, 404, "source_not_found"),
        ({"source": str(tmp_path / "not-a-model")}, 400, "unsupported_source"),
        ({"source": ""}, 400, "invalid_value"),
        ({"source": str(tmp_path), "id": "../escape"}, 400, None),
        ({"path": "x"}, 400, None),
    ]
    for body, status, code in cases:
        got, err = await call(jp_fetch, "POST", "models", body)
        assert got == status, (body, err)
        if code:
            assert err["error"]["code"] == code


@pytest.mark.usefixtures("demo_gguf")
async def test_register_gguf_converts_into_the_store(jp_fetch, lmsp_data):
    status, task = await call(
        jp_fetch, "POST", "models", {"source": str(demo_gguf_path()), "id": "smol"}
    )
    assert status == 202
    done = await finished(jp_fetch, task["id"])
    assert done["state"] == "completed", done
    _, page = await call(jp_fetch, "GET", f"tasks/{task['id']}/events", params={"limit": 1000})
    progress = [e for e in page["data"] if e["type"] == "task.progress"]
    assert progress and progress[-1]["fraction"] <= 1.0
    _, model = await call(jp_fetch, "GET", "models/smol")
    assert model["path"] == str(lmsp_data / "models" / "smol")
    assert {f["path"] for f in model["files"]} >= {"config.json", "tokenizer.json"}
    status, resp = await call(
        jp_fetch,
        "POST",
        "responses",
        {
            "model": "smol",
            "input": "What is the capital of France?",
            "temperature": 0,
            "max_output_tokens": 12,
        },
        # Its first request loads (and verifies) the 135M-parameter model in the worker:
        # well past Tornado's default 20 s when the machine is loaded.
        request_timeout=120,
    )
    assert status == 200
    assert "Paris" in resp["output"][0]["content"][0]["text"]
    # The service made these files, so deleting the model deletes them.
    await call(jp_fetch, "DELETE", "models/smol")
    assert not (lmsp_data / "models" / "smol").exists()


async def test_flipped_byte_fails_the_task_and_marks_the_model_corrupt(
    jp_fetch, test_model_dir, tmp_path
):
    copy = tmp_path / "tampered"
    shutil.copytree(test_model_dir, copy)
    _, task = await call(jp_fetch, "POST", "models", {"source": str(copy), "id": "tampered"})
    assert (await finished(jp_fetch, task["id"]))["state"] == "completed"
    weights = next(copy.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01
    weights.write_bytes(bytes(data))

    status, failed = await call(
        jp_fetch, "POST", "responses", {"model": "tampered", "input": "hi", "max_output_tokens": 3}
    )
    assert status == 200 and failed["status"] == "failed"
    assert failed["error"]["code"] == "model_digest_mismatch"
    assert weights.name in failed["error"]["message"]
    _, model = await call(jp_fetch, "GET", "models/tampered")
    assert model["state"] == "corrupt"
    status, refused = await call(
        jp_fetch, "POST", "responses", {"model": "tampered", "input": "hi", "max_output_tokens": 3}
    )
    assert status == 409 and refused["error"]["code"] == "model_corrupt"
    # The service (and its worker) carry on with the intact model.
    status, ok = await call(jp_fetch, "POST", "responses", {"input": "hi", "max_output_tokens": 3})
    assert status == 200 and ok["status"] in ("completed", "incomplete")
