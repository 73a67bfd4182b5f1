"""transformers' index of its model folders, kept on disk so that each process does not build it.

`import transformers` builds the index its lazy module answers from by reading every Python
file under `transformers/models/` (some 3,400 of them) for its `__all__`
(`transformers.utils.import_utils.create_import_structure_from_path`). That is ~0.9 s of CPU
of the ~1.3 s the import takes here (transformers 5.25), and it is paid by the server (its
prompt counter loads the model's tokenizer through mlx-lm, which imports transformers), by
every inference worker and by every grammar check's child: on each start, for an index that
changes only when transformers is installed again.

`install()` (run when `jupyter_lmsp.engine` is imported, before anything of the engine imports
transformers) wraps that function as the module loads: for the models folder it answers from a
file in the user's cache folder (`~/.cache/jupyter-lmsp/transformers-index/`), written by the
first process that builds it, whose name is a digest of every file's name, size and
modification time under that folder and of the indexing module itself (a 25 ms walk: the way
Python keeps bytecode). Any other folder, a missing or unreadable file, a cache that cannot be
written: the function runs as it would have. The index is stored with `marshal` (dictionaries,
sets and frozensets of strings; nothing in it is executed when read).

The wrapped function is a private one of transformers, so `pyproject.toml` pins transformers to
the minor release tested (a fresh install elsewhere gets the same one). Were a version without it
installed, nothing is wrapped and the import is as slow as before, never wrong;
`tests/test_transformers_index.py` fails, naming it, and checks that the kept index equals the
one transformers builds.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.machinery
import logging
import marshal
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from .usercache import user_cache_dir

log = logging.getLogger(__name__)

MODULE = "transformers.utils.import_utils"
FUNCTION = "create_import_structure_from_path"
# Bumped when what is stored changes shape.
FORMAT = 1


def cache_dir() -> Path:
    return user_cache_dir() / "transformers-index"


def install() -> None:
    """Wrap the indexing function when transformers' `import_utils` loads (at once, if it
    already has: the models' index is then built, but later calls still go through)."""
    loaded = sys.modules.get(MODULE)
    if loaded is not None:
        wrap(loaded)
        return
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def wrap(module: ModuleType) -> bool:
    """Put the cached index in front of `module`'s indexing function; False when the module
    has no such function (a transformers that changed it), or it is wrapped already."""
    original = getattr(module, FUNCTION, None)
    if not callable(original) or getattr(original, "_lmsp_cached", False):
        return False
    models = os.path.normpath(os.path.join(os.path.dirname(module.__file__ or ""), "..", "models"))
    indexer = module.__file__ or ""

    def cached(module_path: Any) -> Any:
        folder = os.path.normpath(str(module_path))
        # Asked for a file, the function indexes its folder: `transformers` asks for the
        # models folder, `transformers.models` for its own `__init__.py`.
        if os.path.basename(folder) == "__init__.py":
            folder = os.path.dirname(folder)
        if folder != models:
            return original(module_path)
        return load_or_build(models, indexer, original)

    cached._lmsp_cached = True  # type: ignore[attr-defined]
    cached.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(module, FUNCTION, cached)
    return True


def load_or_build(folder: str, indexer: str, build: Callable[[str], Any]) -> Any:
    """The index of `folder` from the cache when its files are those it was built from, else
    built (`build(folder)`) and kept."""
    try:
        path = cache_dir() / f"{fingerprint(folder, indexer)}.marshal"
    except OSError:
        return build(folder)
    try:
        return marshal.loads(path.read_bytes())
    except (OSError, ValueError, EOFError, TypeError):
        pass  # not built yet (or unreadable): build it
    index = build(folder)
    try:
        data = marshal.dumps(index)
        path.parent.mkdir(parents=True, exist_ok=True)
        # Written whole then renamed: processes starting together never read half a file.
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".index-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)  # a full disk leaves no half-written file behind
            raise
    except (OSError, ValueError) as e:
        log.debug("transformers' index not kept: %s", e)
    return index


def fingerprint(folder: str, indexer: str) -> str:
    """A digest of every `.py` file's relative path, size and modification time under
    `folder`, and of the indexing module's."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{FORMAT}:{sys.version_info[:2]}:{folder}\0".encode())
    st = os.stat(indexer)
    digest.update(f"{indexer}:{st.st_size}:{st.st_mtime_ns}\0".encode())
    _walk(folder, digest)
    return digest.hexdigest()


def _walk(folder: str, digest: Any) -> None:
    with os.scandir(folder) as entries:
        for entry in sorted(entries, key=lambda e: e.name):
            if entry.name == "__pycache__":
                continue
            if entry.is_dir():
                digest.update(f"{entry.name}/\0".encode())
                _walk(entry.path, digest)
                digest.update(b"..\0")
            elif entry.name.endswith(".py"):
                st = entry.stat()
                digest.update(f"{entry.name}:{st.st_size}:{st.st_mtime_ns}\0".encode())


# Finder and loader by protocol, not by subclassing `importlib.abc`: importing that module costs
# ~13 ms, in every process that imports the engine.
class _Finder:
    """A meta path finder that finds nothing itself: for transformers' `import_utils` it asks
    the other finders, and has the module's loader wrap the indexing function once the module
    has run."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader)  # type: ignore[assignment]  # a Loader by protocol
                return spec
        return None


class _Loader:
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        # The loader the module keeps is the real one (`__loader__`, `__spec__.loader`).
        module.__loader__ = self.inner
        if module.__spec__ is not None:
            module.__spec__.loader = self.inner
        self.inner.exec_module(module)
        wrap(module)
