"""Named fail points for crash and fault tests: `LMSP_FAILPOINTS=name[,name…]` arms them.

An armed point makes the process kill itself with SIGKILL when it reaches it, exactly as
`kill -9` would at that instant; a point whose name starts with `raise_` raises an unexpected
exception there instead (the server's handling of a bug: a 500, and what it logs).

Unset (always, in use), `hit` is one set look-up.
"""

from __future__ import annotations

import os
import signal

_ARMED = frozenset(filter(None, os.environ.get("LMSP_FAILPOINTS", "").split(",")))


class FailPointError(RuntimeError):
    """Raised by an armed `raise_…` fail point."""


def hit(name: str) -> None:
    if name in _ARMED:
        if name.startswith("raise_"):
            raise FailPointError(f"fail point {name}")
        os.kill(os.getpid(), signal.SIGKILL)
