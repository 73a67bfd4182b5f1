"""Checking mlx-lm's internals: failures that name the internal, our file using it, and the
installed mlx-lm version (tests/test_mlx_lm_internals.py, tests/test_mlx_lm_runs.py)."""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
from collections.abc import Callable, Iterable
from typing import Any

VERSION = importlib.metadata.version("mlx-lm")
SPEC_BATCH = "jupyter_lmsp/engine/spec_batch.py"
BATCHING = "jupyter_lmsp/engine/batching.py"


# Who uses each mlx-lm name (for the message when one cannot be imported).
USERS = {
    "GenerationBatch": SPEC_BATCH,
    "StopSequences": f"{SPEC_BATCH} (GenerationBatch._matchers)",
    "TokenBuffer": f"{SPEC_BATCH} (GenerationBatch._token_context)",
    "PromptProcessingBatch": BATCHING,
    "BatchGenerator": BATCHING,
    "generate_step": BATCHING,
    "KVCache": f"{SPEC_BATCH}, jupyter_lmsp/engine/prompt_cache.py",
    "BatchKVCache": SPEC_BATCH,
    "_BaseCache": SPEC_BATCH,
    "dynamic_roll": SPEC_BATCH,
    "make_prompt_cache": BATCHING,
    "create_attention_mask": f"{SPEC_BATCH} (RaggedKVCache.make_mask)",
    "TokenizerWrapper": "jupyter_lmsp/engine/loader.py, worker.py, constraints.py",
    "json_tools": "jupyter_lmsp/engine/toolcalls.py",
    "load_tokenizer": "jupyter_lmsp/engine/tokens.py",
    "apply_top_p": "jupyter_lmsp/engine/sampling.py",
}


def internal(module: str, name: str) -> Any:
    """`from module import name`, failing with the internal's name and who uses it."""
    try:
        found = importlib.import_module(module)
        if hasattr(found, name):
            return getattr(found, name)
        if hasattr(found, "__path__"):  # a package: `name` may be a submodule (tool parsers)
            return importlib.import_module(f"{module}.{name}")
    except ImportError as e:
        raise changed(f"{module}.{name}", USERS.get(name, "jupyter_lmsp/engine"), str(e)) from e
    raise changed(f"{module}.{name}", USERS.get(name, "jupyter_lmsp/engine"), "gone")


def internals(module: str, *names: str) -> tuple[Any, ...]:
    return tuple(internal(module, name) for name in names)


class InternalChanged(AssertionError):
    pass


def changed(internal: str, ours: str, detail: str) -> InternalChanged:
    return InternalChanged(
        f"mlx-lm {VERSION}: `{internal}` is not what {ours} relies on: {detail}. "
        "See tests/test_mlx_lm_internals.py, tests/test_mlx_lm_runs.py and the mlx-lm pin in "
        "pyproject.toml."
    )


def require(ok: object, internal: str, ours: str, detail: str) -> None:
    if not ok:
        raise changed(internal, ours, detail)


def accepts(func: Callable[..., Any], names: Iterable[str], internal: str, ours: str) -> None:
    """`func` takes each of `names` by keyword and needs no other argument (we pass only
    those)."""
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError) as e:
        raise changed(internal, ours, f"no signature ({e})") from e
    params = signature.parameters
    names = list(names)
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in params.values())
    missing = [n for n in names if n not in params and not takes_kwargs]
    require(not missing, internal, ours, f"no parameter {missing}; it takes {list(params)}")
    needed = [
        n
        for n, p in params.items()
        if n not in names
        and n not in ("self", "cls")
        and p.default is p.empty
        and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    require(not needed, internal, ours, f"now requires {needed}, which we do not pass")


def positional_count(func: Callable[..., Any]) -> int:
    """How many positional parameters `func` has, `self` excluded."""
    params = list(inspect.signature(func).parameters.values())
    count = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)
    return count - (1 if params and params[0].name == "self" else 0)


def has_attributes(obj: object, names: Iterable[str], internal: str, ours: str) -> None:
    missing = [n for n in names if not hasattr(obj, n)]
    require(not missing, internal, ours, f"no attribute {missing}")
