"""transformers' index of its model folders, kept on disk (jupyter_lmsp/engine/transformers_index.py).

The wrapped function is a private one of transformers: the first test fails, naming it, when
the installed transformers no longer has it (the import is then as slow as before, not wrong);
the index read back must equal the one transformers builds, and must be built again when a file
under the folder changes. The checks of real imports run in fresh interpreters: this one has
long imported transformers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from jupyter_lmsp.engine import transformers_index

CHECK = r"""
import json, os, sys
import jupyter_lmsp.engine
from transformers import AutoTokenizer
import transformers.utils.import_utils as iu
fn = getattr(iu, "create_import_structure_from_path", None)
models = os.path.join(os.path.dirname(iu.__file__), "..", "models")
out = {"wrapped": bool(getattr(fn, "_lmsp_cached", False)), "tokenizer": AutoTokenizer.__name__}
if out["wrapped"]:
    # What the process was answered (from the cache when it was there) against what
    # transformers builds itself.
    kept = fn(models)
    built = fn.__wrapped__.__wrapped__(os.path.normpath(models))
    out["equal"] = kept == built
    out["entries"] = sum(len(v) for v in iu.spread_import_structure(kept).values())
print(json.dumps(out))
"""


def _run(cache: Path) -> dict[str, Any]:
    env = dict(os.environ, XDG_CACHE_HOME=str(cache))
    done = subprocess.run(
        [sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_transformers_still_has_the_function_and_the_kept_index_is_its_own(tmp_path: Path) -> None:
    first = _run(tmp_path)
    assert first["wrapped"], (
        "transformers.utils.import_utils.create_import_structure_from_path is gone or changed "
        "in the installed transformers: jupyter_lmsp/engine/transformers_index.py wraps nothing, "
        "and every process imports transformers ~0.5 s slower"
    )
    kept = list((tmp_path / "jupyter-lmsp" / "transformers-index").glob("*.marshal"))
    assert len(kept) == 1, kept
    assert first["equal"] and first["entries"] > 1000, first
    # A second process reads the kept index and gets the same answers.
    second = _run(tmp_path)
    assert second == first
    assert list((tmp_path / "jupyter-lmsp" / "transformers-index").glob("*.marshal")) == kept
    assert second["tokenizer"] == "AutoTokenizer"


def _tree(root: Path) -> Path:
    (root / "models" / "a").mkdir(parents=True)
    (root / "models" / "a" / "configuration_a.py").write_text("__all__ = ['AConfig']\n")
    (root / "models" / "b.py").write_text("x = 1\n")
    (root / "import_utils.py").write_text("# the indexer\n")
    return root


def test_the_index_is_built_once_and_again_when_a_file_changes(
    tmp_path: Path, monkeypatch: Any
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    root = _tree(tmp_path / "pkg")
    folder, indexer = str(root / "models"), str(root / "import_utils.py")
    builds: list[str] = []

    def build(path: str) -> dict[Any, Any]:
        builds.append(path)
        names = sorted(p.name for p in Path(path).rglob("*.py"))
        return {frozenset(): {n: {n.upper()} for n in names}, frozenset({"t"}): {}}

    first = transformers_index.load_or_build(folder, indexer, build)
    again = transformers_index.load_or_build(folder, indexer, build)
    assert builds == [folder] and again == first
    assert again[frozenset()]["configuration_a.py"] == {"CONFIGURATION_A.PY"}
    # A file added, one rewritten at another size, the indexer itself changed: each is built anew.
    (root / "models" / "a" / "tokenization_a.py").write_text("__all__ = []\n")
    assert (
        "tokenization_a.py" in transformers_index.load_or_build(folder, indexer, build)[frozenset()]
    )
    (root / "models" / "b.py").write_text("x = 12\n")
    transformers_index.load_or_build(folder, indexer, build)
    (root / "import_utils.py").write_text("# the indexer, changed\n")
    transformers_index.load_or_build(folder, indexer, build)
    assert len(builds) == 4
    transformers_index.load_or_build(folder, indexer, build)
    assert len(builds) == 4


def test_an_unwritable_or_broken_cache_still_answers(tmp_path: Path, monkeypatch: Any) -> None:
    root = _tree(tmp_path / "pkg")
    folder, indexer = str(root / "models"), str(root / "import_utils.py")
    built = {frozenset(): {"m": {"M"}}}
    # The cache folder's place is a file: nothing can be kept, the index is still answered.
    (tmp_path / "blocked").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "blocked"))
    assert transformers_index.load_or_build(folder, indexer, lambda _: built) == built
    # A kept file cut short is built again (and replaced).
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    transformers_index.load_or_build(folder, indexer, lambda _: built)
    (kept,) = (tmp_path / "cache" / "jupyter-lmsp" / "transformers-index").glob("*.marshal")
    kept.write_bytes(kept.read_bytes()[:5])
    calls: list[str] = []

    def counted(path: str) -> dict[Any, Any]:
        calls.append(path)
        return built

    assert transformers_index.load_or_build(folder, indexer, counted) == built
    assert calls == [folder]
    assert transformers_index.load_or_build(folder, indexer, counted) == built
    assert calls == [folder]
