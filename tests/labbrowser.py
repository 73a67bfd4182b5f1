"""Headless Chromium for the browser tests (test_browser_widgets, test_labextension): Debian's
/usr/bin/chromium driven by Playwright, so nothing is downloaded.

A test module imports `jp_asyncio_loop` and `jp_server_cleanup` from here: defined in the
module, they override pytest-jupyter's autouse fixtures of those names (loaded by other test
modules), which break next to Playwright.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from prerequisites import require, require_module

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def require_browser() -> None:
    """Skip the calling test or fixture when Chromium or Playwright is missing (fail it when
    `CI` is set: the browser tier must run there)."""
    require(CHROMIUM.exists(), "chromium at /usr/bin/chromium (`make chromium`)")
    require_module("playwright.sync_api", "playwright (the test extra)")


@contextmanager
def chromium_page(width: int, height: int) -> Iterator[Any]:
    """A page of a fresh headless Chromium, which is closed afterwards."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True
        )
        try:
            yield browser.new_page(viewport={"width": width, "height": height})
        finally:
            browser.close()


# The LMSP sidebar's plugin id, and its panel's DOM id.
PLUGIN = "jupyter-lmsp-labextension:sidebar"
SIDEBAR = "#jp-lmsp-sidebar"


@contextmanager
def lab_page(url: str, token: str, width: int, height: int, script: str) -> Iterator[Any]:
    """JupyterLab at `url` in a fresh page, restored, the sidebar's plugin loaded and `script`
    evaluated; on leaving, no page error may have named LMSP."""
    with chromium_page(width, height) as page:
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(f"{url}lab?token={token}")
        page.wait_for_function("() => window.jupyterapp !== undefined", timeout=60_000)
        page.evaluate("() => window.jupyterapp.restored.then(() => true)")
        assert page.evaluate(f"() => window.jupyterapp.hasPlugin('{PLUGIN}')"), errors
        page.evaluate(script)
        yield page
        assert not [e for e in errors if "lmsp" in e.lower()], errors


@pytest.fixture
def jp_asyncio_loop() -> Iterator[asyncio.AbstractEventLoop]:
    """Overrides pytest-jupyter's autouse fixture of this name.

    Between its sync calls, Playwright marks its own loop as the running one; the plugin's
    fixture then takes that loop for the test's and closes it at teardown ("Cannot close a
    running event loop") once an earlier jp_fetch test has left its loop closed. The browser
    tests use no asyncio themselves, so a private loop is enough.
    """
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture
def jp_server_cleanup() -> None:
    """Overrides pytest-jupyter's autouse cleanup: the browser tests make no in-process
    ServerApp (and running its cleanup on a loop fails while Playwright's loop is marked
    running)."""
