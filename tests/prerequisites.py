"""What a test tier needs that a machine may lack (a browser, the demo model's package, the
sidebar's node_modules, OpenBLAS): `require(condition, what)` skips the test when it is missing,
except when `CI` is set, where a missing prerequisite fails the test instead. CI cannot pass on
work it skipped."""

from __future__ import annotations

import os
import sys

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


def require(condition: object, what: str) -> None:
    """Go on if `condition` holds; otherwise skip (fail under CI) saying `what` is missing."""
    if condition:
        return
    message = f"missing: {what}"
    if in_ci():
        pytest.fail(f"{message} (CI is set: a test tier that cannot run fails the run)")
    pytest.skip(message)


def require_module(name: str, what: str | None = None) -> None:
    try:
        __import__(name)
    except ImportError:
        require(False, what or f"the Python package {name}")


def require_linux(what: str) -> None:
    """Linux-only mechanisms (`/proc`, the Linux BLAS recipe): elsewhere they do not apply, a
    skip even under CI (the platform is not a missing prerequisite)."""
    if not sys.platform.startswith("linux"):
        pytest.skip(f"{what}: Linux only")
