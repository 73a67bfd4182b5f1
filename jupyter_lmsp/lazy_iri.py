"""Defer the grammar build of `rfc3987_syntax` until an IRI is actually checked.

The `jupyter lmsp …` commands import Jupyter Server (their settings are an `LMSPExtension`),
which imports jupyter_events, which imports jsonschema, whose format checkers import
`rfc3987_syntax` when it is installed — and that module builds some thirty Lark Earley parsers at
import: 1.3 s of the 2.5 s that `import jupyter_lmsp.cli` took (`python -X importtime`), in
every command, for IRI format checks no command runs (jsonschema issue #1428: the import stays
eager in jsonschema 4.26).

`defer()` registers a stand-in under that name before Jupyter Server is imported. jsonschema
takes one function from it, `is_valid_syntax`; the stand-in's imports the real module on its
first call and answers with it, as does any other attribute: the same answers, only later. The
real module then replaces the stand-in in `sys.modules`.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
from types import ModuleType
from typing import Any

NAME = "rfc3987_syntax"

_lock = threading.Lock()
_real: ModuleType | None = None


def real_module() -> ModuleType:
    """The real `rfc3987_syntax`, imported on first use (in place of the stand-in)."""
    global _real
    if _real is not None:
        return _real
    with _lock:
        if _real is None:
            stand_in = sys.modules.pop(NAME, None)
            try:
                _real = importlib.import_module(NAME)
            except BaseException:
                if stand_in is not None:
                    sys.modules[NAME] = stand_in
                raise
        return _real


def is_valid_syntax(term: str, value: str) -> bool:
    """`rfc3987_syntax.is_valid_syntax`, from the real module."""
    return bool(real_module().is_valid_syntax(term, value))


def _attribute(name: str) -> Any:
    # The import system asks a module for `__path__` and the like (`from rfc3987_syntax import
    # …` does); those must not import the real module.
    if name.startswith("__"):
        raise AttributeError(name)
    return getattr(real_module(), name)


def defer() -> bool:
    """Register the stand-in, unless the real module (or jsonschema's use of it) is already
    imported or it is not installed. Returns whether it did."""
    if NAME in sys.modules or "jsonschema._format" in sys.modules:
        return False
    if importlib.util.find_spec(NAME) is None:
        return False
    stand_in = ModuleType(NAME, f"Stand-in for {NAME}, imported on first use ({__name__}).")
    stand_in.is_valid_syntax = is_valid_syntax  # type: ignore[attr-defined]
    stand_in.__getattr__ = _attribute  # type: ignore[method-assign]
    sys.modules[NAME] = stand_in
    return True
