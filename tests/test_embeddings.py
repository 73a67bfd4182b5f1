"""`POST /embeddings` (issue 39) through the openai SDK and LangChain's `OpenAIEmbeddings`,
against one in-process Jupyter Server whose worker serves two models: `tiny` (the test model,
a causal LM: mean pooling) and `tiny-embed` (the same weights with a sentence-transformers
configuration naming last-token pooling: an embedding model, which refuses chat).

Every vector is checked against the same model run directly with mlx-lm in this process
(`model.model(ids)`, pooled and normalised here), so the service computes what the model
computes; the queue's batching of several jobs into one pass is checked at the engine level,
with the real model.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
from inprocess_cli import run_cli
from jpserver import BASE_URL, SharedServer, server_config, shared_server
from serverproc import MODEL, http_client, with_test_model

from jupyter_lmsp.engine.embedding import EmbeddingQueue, EmbedRequest, embed_rows

pytestmark = pytest.mark.timeout(120)

EMBED = "tiny-embed"
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Paris", "Jupyter notebooks mix code."]


def make_embedding_model(path: Path, test_model_dir: Path) -> Path:
    """The test model as a sentence-transformers embedding model with last-token pooling (as
    Qwen3-Embedding's configuration names it)."""
    shutil.copytree(test_model_dir, path)
    (path / "modules.json").write_text(
        json.dumps(
            [
                {
                    "idx": 0,
                    "name": "0",
                    "path": "",
                    "type": "sentence_transformers.models.Transformer",
                },
                {
                    "idx": 1,
                    "name": "1",
                    "path": "1_Pooling",
                    "type": "sentence_transformers.models.Pooling",
                },
                {
                    "idx": 2,
                    "name": "2",
                    "path": "2_Normalize",
                    "type": "sentence_transformers.models.Normalize",
                },
            ]
        )
    )
    (path / "config_sentence_transformers.json").write_text(json.dumps({"prompts": {}}))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 64, "pooling_mode_lasttoken": True})
    )
    return path


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, test_model_dir: Path, request: Any
) -> Iterator[SharedServer]:
    root = tmp_path_factory.mktemp("embeddings")
    data_dir = root / "lmsp"
    data_dir.mkdir()
    with_test_model(data_dir, test_model_dir)
    make_embedding_model(data_dir / "models" / EMBED, test_model_dir)
    with shared_server(server_config(data_dir, request), root / "jupyter") as s:
        yield s


@pytest.fixture(scope="module")
def client(server: SharedServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=server.url(BASE_URL + "lmsp/v1"), api_key=server.token, max_retries=0
    ) as client:
        yield client


def direct(tiny: tuple[Any, Any], texts: list[str], pooling: str) -> np.ndarray:
    """The vectors mlx-lm gives, one input at a time, pooled and normalised here."""
    import mlx.core as mx

    model, tokenizer = tiny
    out = []
    for text in texts:
        hidden = model.model(mx.array([tokenizer.encode(text)])).astype(mx.float32)[0]
        vector = np.array(hidden[-1] if pooling == "last" else hidden.mean(axis=0))
        out.append(vector / np.linalg.norm(vector))
    return np.stack(out)


def vectors(result: Any) -> np.ndarray:
    return np.array([item.embedding for item in result.data], dtype=np.float32)


def test_sdk_vectors_are_the_models(client: openai.OpenAI, tiny: tuple[Any, Any]) -> None:
    """Mean pooling for a causal LM, last-token for the embedding model; base64 (the SDK's
    default) and float give the same vectors; identical inputs, identical vectors."""
    for model, pooling in ((MODEL, "mean"), (EMBED, "last")):
        result = client.embeddings.create(model=model, input=[*TEXTS, TEXTS[0]])
        got = vectors(result)
        assert got.shape == (4, 64)
        assert [item.index for item in result.data] == [0, 1, 2, 3]
        np.testing.assert_allclose(got[:3], direct(tiny, TEXTS, pooling), atol=2e-5)
        assert np.array_equal(got[0], got[3])
        np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
        floats = client.embeddings.create(model=model, input=TEXTS, encoding_format="float")
        np.testing.assert_allclose(vectors(floats), got[:3], atol=1e-6)
        tokens = sum(len(tiny[1].encode(t)) for t in [*TEXTS, TEXTS[0]])
        assert result.usage.prompt_tokens == result.usage.total_tokens == tokens
        assert result.model == model


def test_token_inputs_and_dimensions(client: openai.OpenAI, tiny: tuple[Any, Any]) -> None:
    ids = [tiny[1].encode(t) for t in TEXTS]
    one = client.embeddings.create(model=EMBED, input=ids[0])
    many = client.embeddings.create(model=EMBED, input=ids)
    text = client.embeddings.create(model=EMBED, input=TEXTS)
    np.testing.assert_allclose(vectors(many), vectors(text), atol=1e-6)
    np.testing.assert_allclose(vectors(one)[0], vectors(text)[0], atol=1e-6)
    short = client.embeddings.create(model=EMBED, input=TEXTS, dimensions=16)
    cut = vectors(text)[:, :16]
    np.testing.assert_allclose(
        vectors(short), cut / np.linalg.norm(cut, axis=1, keepdims=True), atol=1e-5
    )


@pytest.mark.parametrize(
    ("kwargs", "status", "code"),
    [
        ({"model": MODEL, "input": ""}, 400, "invalid_value"),
        ({"model": MODEL, "input": []}, 400, "invalid_value"),
        ({"model": MODEL, "input": [[1, 2], [100000]]}, 400, "invalid_value"),
        ({"model": MODEL, "input": "x", "dimensions": 16}, 400, "invalid_value"),
        ({"model": EMBED, "input": "x", "dimensions": 65}, 400, "invalid_value"),
        ({"model": "no-such-model", "input": "x"}, 404, "model_not_found"),
    ],
)
def test_refusals(client: openai.OpenAI, kwargs: dict[str, Any], status: int, code: str) -> None:
    with pytest.raises(openai.APIStatusError) as caught:
        client.embeddings.create(**kwargs)
    assert caught.value.status_code == status
    assert isinstance(caught.value.body, dict) and caught.value.body["code"] == code


def test_embedding_model_refuses_chat(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=EMBED, messages=[{"role": "user", "content": "Hi"}])
    assert isinstance(caught.value.body, dict)
    assert caught.value.body["code"] == "model_embedding_only"


def test_langchain_and_concurrent_requests(server: SharedServer, client: openai.OpenAI) -> None:
    from langchain_openai import OpenAIEmbeddings

    lc = OpenAIEmbeddings(
        model=EMBED,
        base_url=server.url(BASE_URL + "lmsp/v1"),
        api_key=server.token,  # type: ignore[arg-type]
        # Its default counts tokens with tiktoken (OpenAI's vocabularies, downloaded): a
        # local model has its own tokenizer, which the service applies.
        check_embedding_ctx_length=False,
        max_retries=0,
    )
    docs = lc.embed_documents([*TEXTS, TEXTS[1]])
    query = lc.embed_query(TEXTS[1])
    assert [len(d) for d in docs] == [64] * 4
    assert docs[1] == docs[3] == query
    expected = vectors(client.embeddings.create(model=EMBED, input=TEXTS))
    np.testing.assert_allclose(np.array(docs[:3]), expected, atol=1e-6)
    # Eight clients at once, each its own inputs: every answer is its own.
    with ThreadPoolExecutor(8) as pool:
        answers = list(
            pool.map(
                lambda i: vectors(client.embeddings.create(model=EMBED, input=TEXTS[i % 3])),
                range(8),
            )
        )
    for i, got in enumerate(answers):
        np.testing.assert_allclose(got[0], expected[i % 3], atol=1e-6)


def test_queue_batches_jobs_in_one_pass(tiny: tuple[Any, Any]) -> None:
    """Two jobs waiting together on one model go in one forward pass; vectors are those of
    each input alone (right padding changes no position of a causal model)."""
    model, tokenizer = tiny
    ids = [tokenizer.encode(t) for t in TEXTS]
    queue = EmbeddingQueue()
    queue.add(EmbedRequest("emb_a", ("m",), ids[:2], None, model, "mean"))
    queue.add(EmbedRequest("emb_b", ("m",), ids[2:], None, model, "mean"))
    done = queue.step(budget=4096)
    assert [r.job_id for r in done] == ["emb_a", "emb_b"] and not queue.pending
    assert done[0].passes == done[1].passes == [3]
    alone = np.concatenate([embed_rows(model, [row], "mean") for row in ids])
    together = np.concatenate([done[0].result(), done[1].result()])
    np.testing.assert_allclose(
        together, alone / np.linalg.norm(alone, axis=1, keepdims=True), atol=2e-5
    )
    # A budget of one row per pass: three passes, the shortest inputs first.
    queue.add(EmbedRequest("emb_c", ("m",), ids, None, model, "last"))
    passes = 0
    while queue.pending:
        queue.step(budget=1)
        passes += 1
    assert passes == 3


def test_load_unload_and_the_models_list(server: SharedServer) -> None:
    """`POST /models/{id}/load` and `/unload`; `GET /models` shows the state and the bytes;
    the metrics show the resident models and count unloads (issue 39)."""

    api = server.url(BASE_URL + "lmsp/v1")
    with http_client(
        base_url=api, headers={"Authorization": f"token {server.token}"}, timeout=60
    ) as http:
        gone = http.post(f"/models/{EMBED}/unload")
        assert gone.status_code == 200 and gone.json()["state"] == "available"
        assert gone.json()["loaded_bytes"] is None
        loaded = http.post(f"/models/{EMBED}/load", json={"keep_alive": -1})
        assert loaded.status_code == 200, loaded.text
        assert loaded.json()["state"] == "loaded" and loaded.json()["loaded_bytes"] > 0
        listed = {m["id"]: m for m in http.get("/models").json()["data"]}
        assert listed[EMBED]["state"] == "loaded"
        assert listed[EMBED]["loaded_bytes"] == loaded.json()["loaded_bytes"]
        again = http.post(f"/models/{EMBED}/load")
        assert again.status_code == 200 and again.json()["state"] == "loaded"
        exposition = http.get("/metrics").text
        gauges = dict(
            line.split(" ", 1) for line in exposition.splitlines() if line.startswith("lmsp_models")
        )
        assert float(gauges["lmsp_models_loaded"]) >= 1
        assert float(gauges["lmsp_models_resident_bytes"]) >= loaded.json()["loaded_bytes"]
        unloaded = http.post(f"/models/{EMBED}/unload")
        assert unloaded.json()["state"] == "available"
        assert 'lmsp_model_unloads_total{reason="asked"}' in http.get("/metrics").text
        missing = http.post("/models/no-such-model/load")
        assert missing.status_code == 404


def test_cli_load_and_unload(server: SharedServer, capsys: pytest.CaptureFixture[str]) -> None:
    """`jupyter lmsp models load|unload` against the running server."""
    url = server.url(BASE_URL)
    common = ["--url", url, "--token", server.token]
    assert run_cli(["models", "load", EMBED, "--keep-alive", "-1", *common]) == 0
    assert capsys.readouterr().out.startswith(f"{EMBED}: loaded ")
    assert run_cli(["models", "unload", EMBED, *common]) == 0
    assert capsys.readouterr().out.strip() == f"{EMBED}: available"
    assert run_cli(["models", "load", "no-such-model", *common]) == 1
