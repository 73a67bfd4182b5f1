"""`python -m jupyter_lmsp.launch APP [ARGS...]`: run a Jupyter application's module (`APP`:
`jupyter_server`, `jupyterlab`) as `python -m APP ARGS...` would, with `rfc3987_syntax`'s
grammar build deferred (lazy_iri).

Jupyter Server imports jsonschema's format checkers, which build `rfc3987_syntax`'s Lark parsers
at import: 1.3 s of CPU of the 2.9 s it takes to import Jupyter Server with this extension, spent
by every server that starts and that never checks an IRI. The sandbox
(`client.sandbox.LMSPServerProcess`, which the tests and benchmarks start servers with) launches
through this module; a server started with plain `jupyter server` is the same server, one second
slower to start.
"""

from __future__ import annotations

import runpy
import sys

from jupyter_lmsp import lazy_iri


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: python -m jupyter_lmsp.launch APP [ARGS...]")
    app = sys.argv[1]
    # Before the application's imports reach jsonschema.
    lazy_iri.defer()
    # The application sees its own arguments, as under `python -m APP`.
    sys.argv = [sys.argv[0], *sys.argv[2:]]
    runpy.run_module(app, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
