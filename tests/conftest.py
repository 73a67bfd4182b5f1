"""Shared pytest fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest

from jupyter_lmsp.models.testmodel import make_test_model


@pytest.fixture(scope="session")
def test_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random-weight test model (see jupyter_lmsp.models.testmodel), made once."""
    return make_test_model(tmp_path_factory.mktemp("model"))
