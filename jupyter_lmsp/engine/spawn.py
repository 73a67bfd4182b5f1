"""Start a *spawn*-context process without running the parent's main script again in it.

A spawned child imports its parent's `__main__` before it runs its target, so that functions
defined there can be unpickled. When the parent was started as a console script — `jupyter
server`, `jupyter lmsp worker`, which is how users start it — the child runs that script again as
`__mp_main__`: `from jupyter_server.serverapp import main`, i.e. all of Jupyter Server, which the
inference worker never uses. Measured: 1.3 s more per worker start (the child of a script that
imports `jupyter_server.serverapp` was ready after 1.27–1.44 s, the child of a bare script after
0.04 s), paid at every start and every restart after a crash, and the memory of those modules in
every worker. (`python -m jupyter_server` is spared: multiprocessing skips a main that is a
package's `__main__`.)

The worker's target and arguments live in this package, never in `__main__`, so the child does
not need the parent's main. `start_without_main` hides it from multiprocessing while the process
starts: multiprocessing reads `sys.modules["__main__"]` once, when it writes the child's
preparation data in `Process.start()`.
"""

from __future__ import annotations

import sys
import threading
import types
from multiprocessing.process import BaseProcess

# sys.modules is process-wide: one start at a time swaps the main module.
_MAIN_LOCK = threading.Lock()


def _script_main() -> types.ModuleType | None:
    """This process's main module if a spawned child would run it again: a script (not a
    module run with `-m`, nor an interactive session); else None."""
    main = sys.modules.get("__main__")
    if main is None or getattr(main, "__spec__", None) is not None:
        return None
    return main if getattr(main, "__file__", None) is not None else None


def main_reruns_in_child() -> bool:
    """Whether a spawned child would run this process's main script again."""
    return _script_main() is not None


def start_without_main(process: BaseProcess) -> None:
    """`process.start()`, with the parent's main script hidden from multiprocessing so that the
    child does not import it. The target must not live in `__main__`."""
    with _MAIN_LOCK:
        main = _script_main()
        if main is None:
            process.start()
            return
        # A main module with neither a spec nor a file: multiprocessing then records nothing to
        # re-run. Swapped back at once; Process.start() returns once the child is launched.
        sys.modules["__main__"] = types.ModuleType("__main__")
        try:
            process.start()
        finally:
            sys.modules["__main__"] = main
