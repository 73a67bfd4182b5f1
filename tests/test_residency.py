"""Loaded models within a memory budget (issue 39): one real inference worker (`EngineClient`)
with three test models and a budget that holds two; `engine.residency` alone with a clock.

The worker reports each load and unload (`ModelLoaded`, `ModelUnloaded`), which is what these
tests read: the least recently used idle model goes for room, a model with a generation in
flight never does, `keep_alive: 0` unloads a model as soon as its request is done, and eight
first requests for one model at once load it once.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from test_engine import CHAT, Engine, new_id, start_engine

from jupyter_lmsp.engine.messages import (
    CancelJob,
    EmbedJob,
    EmbedResult,
    GenerateJob,
    JobCancelled,
    JobStarted,
    ModelLoaded,
    ModelUnloaded,
    WorkerSettings,
)
from jupyter_lmsp.engine.residency import Residency, model_bytes
from jupyter_lmsp.models.testmodel import make_test_model

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("residency")
    return {name: make_test_model(root / name, seed=i) for i, name in enumerate("abcd")}


@pytest.fixture(scope="module")
def engine(models: dict[str, Path]) -> Iterator[Engine]:
    from mlx_lm import load

    size = model_bytes(load(str(models["a"]))[0])
    # Two models fit, three do not; a slow decode leaves time to act while a job runs.
    settings = WorkerSettings(max_loaded_bytes=int(size * 2.5))
    eng = start_engine(models["a"], token_delay=0.05, settings=settings)
    yield eng
    eng.client.stop()


def embed(engine: Engine, path: Path, keep_alive: float | None = None) -> str:
    job = EmbedJob(new_id("emb"), str(path), ["hello there"], keep_alive=keep_alive)
    engine.client.send(job)
    return job.job_id


def wait_result(engine: Engine, job_id: str) -> EmbedResult:
    result = engine.recorder.wait_for(lambda m: getattr(m, "job_id", None) == job_id)
    assert isinstance(result, EmbedResult), result
    return result


def events(engine: Engine, since: int) -> list[tuple[str, str, str]]:
    out = []
    for message in engine.recorder.messages[since:]:
        if isinstance(message, ModelLoaded):
            out.append(("loaded", Path(message.path).name, ""))
        elif isinstance(message, ModelUnloaded):
            out.append(("unloaded", Path(message.path).name, message.reason))
    return out


def test_budget_evicts_the_least_recently_used_idle_model(
    engine: Engine, models: dict[str, Path]
) -> None:
    since = engine.recorder.mark()
    for name in "abc":
        wait_result(engine, embed(engine, models[name]))
    assert events(engine, since) == [
        ("loaded", "a", ""),
        ("loaded", "b", ""),
        ("loaded", "c", ""),
        ("unloaded", "a", "budget"),
    ]
    # b is now the least recently used; a generation keeps it busy while a comes back.
    since = engine.recorder.mark()
    job = GenerateJob(new_id(), str(models["b"]), CHAT, max_tokens=400)
    engine.client.submit(job)
    engine.recorder.wait_for(lambda m: isinstance(m, JobStarted) and m.job_id == job.job_id)
    wait_result(engine, embed(engine, models["a"]))
    assert events(engine, since) == [("loaded", "a", ""), ("unloaded", "c", "budget")]
    engine.client.cancel(job.job_id)
    engine.recorder.wait_for(lambda m: isinstance(m, JobCancelled) and m.job_id == job.job_id)


def test_keep_alive_zero_unloads_after_the_request(engine: Engine, models: dict[str, Path]) -> None:
    since = engine.recorder.mark()
    wait_result(engine, embed(engine, models["d"], keep_alive=0))
    engine.recorder.wait_for(
        lambda m: isinstance(m, ModelUnloaded) and Path(m.path).name == "d", since=since
    )
    assert ("unloaded", "d", "idle") in events(engine, since)


def test_concurrent_first_requests_load_once(engine: Engine, models: dict[str, Path]) -> None:
    since = engine.recorder.mark()
    # c was unloaded for room: eight requests for it at once.
    ids = [embed(engine, models["c"]) for _ in range(8)]
    results = [wait_result(engine, job_id) for job_id in ids]
    assert len({r.vectors for r in results}) == 1
    assert [e for e in events(engine, since) if e[0] == "loaded"] == [("loaded", "c", "")]
    # A cancel of an embedding is silent: nothing more comes for it.
    engine.client.send(CancelJob("emb_unknown"))


def test_residency_keep_alive_and_busy_models() -> None:
    now = [0.0]
    residency = Residency(max_bytes=100, keep_alive=10.0, clock=lambda: now[0])
    for key in "abc":
        residency.loaded(key, 40)
        now[0] += 1
    assert residency.over_budget(busy={"a"}) == ["b"]
    residency.used("c", keep_alive=0)
    residency.used("b", keep_alive=-1)
    assert residency.expired(busy=set()) == ["c"]
    now[0] += 10
    assert residency.expired(busy={"a"}) == ["c"]
    assert residency.expired(busy=set()) == ["a", "c"]
    assert residency.next_expiry(busy={"a", "c"}) is None
