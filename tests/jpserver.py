"""The extension inside pytest-jupyter's in-process Jupyter Server (`jp_fetch`), as
test_chat and test_http_spine use it.

`server_config` is what a module's `jp_server_config` fixture returns, given the data folder
of conftest's `lmsp_data` fixture. `call` answers (status, body, headers) for errors as well as
successes, and `wait_state` polls a task until it reaches one of the given states.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Collection
from pathlib import Path
from typing import Any

import pytest
from serverproc import MODEL
from tornado.httpclient import HTTPClientError

Fetch = Callable[..., Awaitable[Any]]


def server_config(data_dir: Path, request: pytest.FixtureRequest, **traits: Any) -> dict[str, Any]:
    """The server's configuration: the extension on `data_dir`, plus LMSPExtension `traits`.

    `@pytest.mark.token_delay(s)` on a test slows generation so the test can act while it runs.
    """
    marker = request.node.get_closest_marker("token_delay")
    return {
        "ServerApp": {"jpserver_extensions": {"jupyter_lmsp": True}},
        "LMSPExtension": {
            "data_dir": str(data_dir),
            "default_model": MODEL,
            "use_openblas": "no",
            "keepalive_interval": 0.5,
            "engine_token_delay": marker.args[0] if marker else 0.0,
            **traits,
        },
    }


async def call(
    jp_fetch: Fetch,
    method: str,
    path: str,
    body: Any = None,
    raw: bool = False,
    **kw: Any,
) -> tuple[int, Any, Any]:
    """`method` on `lmsp/v1/<path>`: (status, body, headers). A str `body` is sent as it is,
    anything else as JSON; `raw` answers the body as text instead of parsed JSON."""
    kwargs: dict[str, Any] = {"method": method, **kw}
    if body is not None:
        kwargs["body"] = body if isinstance(body, str) else json.dumps(body)
    elif method == "POST":
        kwargs["body"] = "{}"
    try:
        response = await jp_fetch("lmsp", "v1", *path.split("/"), **kwargs)
    except HTTPClientError as e:
        return e.code, json.loads(e.response.body), e.response.headers
    text = response.body.decode()
    return response.code, text if raw else json.loads(text), response.headers


async def wait_state(
    jp_fetch: Fetch, task_id: str, states: Collection[str], timeout: float = 60.0
) -> dict[str, Any]:
    task: dict[str, Any] = {}
    for _ in range(int(timeout / 0.05)):
        _, task, _ = await call(jp_fetch, "GET", f"tasks/{task_id}")
        if task["state"] in states:
            return task
        await asyncio.sleep(0.05)
    raise AssertionError(f"task {task_id} never reached {states}: {task}")
