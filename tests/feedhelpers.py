"""Helpers of the feed tests (test_postgres_feed, test_sqlite_feed): a task runner that runs no
generation, and waiting until a feed listens."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from jupyter_lmsp.services.bus import EventBus
from jupyter_lmsp.services.catalog import ModelCatalog
from jupyter_lmsp.services.feed import EventFeed
from jupyter_lmsp.services.runner import TaskRunner
from jupyter_lmsp.store.database import Database


def idle_runner(db: Database, bus: EventBus, tmp_path: Path) -> TaskRunner:
    """A runner on `db` whose engine is never started (the tests run no generation)."""

    def no_engine(_on_message: Any) -> Any:
        raise AssertionError("this test runs no generation")

    return TaskRunner(db, bus, ModelCatalog(db, tmp_path, None), no_engine)


async def listening(feed: EventFeed, timeout: float = 10.0) -> None:
    """Until the feed listens (and has read what was committed before)."""
    loop = asyncio.get_running_loop()
    assert await loop.run_in_executor(None, feed.listening.wait, timeout), "never listened"
