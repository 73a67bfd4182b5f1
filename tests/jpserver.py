"""The extension inside pytest-jupyter's in-process Jupyter Server (`jp_fetch`), as
test_chat and test_http_spine use it.

`server_config` is what a module's `jp_server_config` fixture returns, given the data folder
of conftest's `lmsp_data` fixture. `call` answers (status, body, headers) for errors as well as
successes, and `wait_state` polls a task until it reaches one of the given states.

pytest-jupyter's server is made anew for every test (its `jp_serverapp` is function-scoped),
and each then starts its own inference worker. `SharedServer` is the same server started once
for several tests, and `ServerPool` a module's (or class's) shared servers, one per
configuration; a module that uses them defines its own `jp_fetch` fixture on them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import sys
import threading
import urllib.parse
from collections.abc import Awaitable, Callable, Collection, Hashable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest
from serverproc import MODEL, with_test_model
from tornado.httpclient import HTTPClientError

Fetch = Callable[..., Awaitable[Any]]


def token_delay(request: pytest.FixtureRequest) -> float:
    """The test's `@pytest.mark.token_delay(s)`, 0.0 without one."""
    marker = request.node.get_closest_marker("token_delay")
    return float(marker.args[0]) if marker else 0.0


def server_config(data_dir: Path, request: pytest.FixtureRequest, **traits: Any) -> dict[str, Any]:
    """The server's configuration: the extension on `data_dir`, plus LMSPExtension `traits`.

    `@pytest.mark.token_delay(s)` on a test slows generation so the test can act while it runs.
    """
    return {
        "ServerApp": {"jpserver_extensions": {"jupyter_lmsp": True}},
        "LMSPExtension": {
            "data_dir": str(data_dir),
            "default_model": MODEL,
            "use_openblas": "no",
            "keepalive_interval": 0.5,
            "engine_token_delay": token_delay(request),
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
        if e.response is None:  # no answer at all (599: the client's timeout)
            raise
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


# -- one server for several tests ------------------------------------------------------------

# pytest-jupyter's `jp_base_url`: the shared server is mounted where its function-scoped one is.
BASE_URL = "/a%40b/"


class SharedServer:
    """An in-process Jupyter Server with the extension, as pytest-jupyter's `jp_serverapp`
    makes it (same settings, same base URL, a private Jupyter environment), but started once
    for several tests: its IOLoop runs in a thread of its own, so it outlives each test's
    event loop, and `fetch` is `jp_fetch` over a real socket from the test's loop.

    It is not the `ServerApp` singleton: pytest-jupyter's autouse `jp_server_cleanup`, which
    cleans up the singleton after every test, leaves it alone.
    """

    def __init__(self, config: dict[str, Any], root: Path) -> None:
        self.config = config
        self.root = root
        self.data_dir: Path | None = None
        self.app: Any = None
        self.token = ""
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._http_server: Any = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self._thread.start()
        ready.result(timeout=120)

    def _run(self, ready: concurrent.futures.Future[None]) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self._loop = loop
        try:
            loop.run_until_complete(self._start())
        except BaseException as e:
            ready.set_exception(e)
            loop.close()
            return
        ready.set_result(None)
        loop.run_forever()
        loop.close()

    async def _start(self) -> None:
        from jupyter_server.serverapp import ServerApp
        from tornado.httpserver import HTTPServer
        from tornado.testing import bind_unused_port
        from traitlets.config import Config

        config = Config(self.config)
        # As pytest-jupyter's `jp_configurable_serverapp` sets it up.
        extensions = config.ServerApp.setdefault("jpserver_extensions", {})
        extensions.setdefault("jupyter_server_terminals", True)
        config.NotebookNotary.db_file = ":memory:"
        if "token" not in config.ServerApp and not config.IdentityProvider.token:
            config.IdentityProvider.token = os.urandom(4).hex()
        sock, self.port = bind_unused_port()
        root_dir = self.root / "root_dir"
        root_dir.mkdir(exist_ok=True)
        app = ServerApp(
            log_level="DEBUG",
            port=self.port,
            port_retries=0,
            open_browser=False,
            base_url=BASE_URL,
            config=config,
            allow_root=True,
            root_dir=str(root_dir),
        )
        app.init_signal = lambda: None  # type: ignore[method-assign]
        app.initialize(argv=[], new_httpserver=False)
        app.log.propagate = True
        app.log.handlers = []
        app.start_app()
        self.app = app
        self.token = app.identity_provider.token
        self._http_server = HTTPServer(app.web_app)
        self._http_server.add_socket(sock)

    def stop(self) -> None:
        if self._loop is None or self._thread is None:
            return

        async def stop() -> None:
            if self._http_server is not None:
                self._http_server.stop()
                await self._http_server.close_all_connections()
            if self.app is not None:
                await self.app._cleanup()

        try:
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(timeout=60)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=60)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def client(self) -> SharedClient:
        """A client for the calling test's event loop (close it at the end of the test)."""
        return SharedClient(self)


class SharedClient:
    """`jp_fetch` (`fetch`) and `http_server_client` (`client.fetch`, no credentials) for a
    `SharedServer`, on the event loop of the test that makes it."""

    def __init__(self, server: SharedServer) -> None:
        from tornado.simple_httpclient import SimpleAsyncHTTPClient

        self.server = server
        self.client = _UnauthenticatedClient(server, SimpleAsyncHTTPClient(force_instance=True))

    def fetch(
        self,
        *parts: str,
        headers: dict[str, str] | None = None,
        params: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> Awaitable[Any]:
        """What pytest-jupyter's `jp_fetch` does, against the shared server."""
        from jupyter_server.utils import url_path_join
        from tornado.escape import url_escape

        headers = dict(headers or {})
        path_url = url_escape(url_path_join(*parts), plus=False)
        url = url_path_join(BASE_URL, path_url) + "?" + urllib.parse.urlencode(params or {})
        headers.setdefault("Authorization", f"token {self.server.token}")
        # Generous: a request waits its turn behind model loads and grammar compiles, which
        # take many times longer on a loaded machine (issue 43: make test beside a CPU hog).
        request_timeout = kwargs.pop("request_timeout", 120)
        return self.client.fetch(url, headers=headers, request_timeout=request_timeout, **kwargs)

    def close(self) -> None:
        self.client.http.close()


class _UnauthenticatedClient:
    def __init__(self, server: SharedServer, http: Any) -> None:
        self.server = server
        self.http = http

    def fetch(self, path: str, **kwargs: Any) -> Awaitable[Any]:
        return self.http.fetch(self.server.url(path), **kwargs)


@contextmanager
def shared_server(
    config: dict[str, Any], root: Path, env: dict[str, str] | None = None
) -> Iterator[SharedServer]:
    """A running `SharedServer` with `config`, in a private Jupyter environment under `root`
    (pytest-jupyter's `jp_environ`: HOME and the Jupyter folders), plus `env`, for as long as
    the context lasts. The environment is the test process's while it runs (the server's
    inference worker inherits it)."""
    import jupyter_core.paths

    with pytest.MonkeyPatch.context() as mp:
        for name, folder in (
            ("HOME", "home"),
            ("JUPYTER_CONFIG_DIR", "config"),
            ("JUPYTER_DATA_DIR", "data"),
            ("JUPYTER_RUNTIME_DIR", "runtime"),
        ):
            (root / folder).mkdir(parents=True, exist_ok=True)
            mp.setenv(name, str(root / folder))
        mp.setenv("PYTHONPATH", os.pathsep.join(sys.path))
        for attr, folder in (
            ("SYSTEM_JUPYTER_PATH", "share/jupyter"),
            ("ENV_JUPYTER_PATH", "env/share/jupyter"),
            ("SYSTEM_CONFIG_PATH", "etc/jupyter"),
            ("ENV_CONFIG_PATH", "env/etc/jupyter"),
        ):
            (root / folder).mkdir(parents=True, exist_ok=True)
            mp.setattr(jupyter_core.paths, attr, [str(root / folder)])
        for name, value in (env or {}).items():
            mp.setenv(name, value)
        server = SharedServer(config, root)
        server.start()
        try:
            yield server
        finally:
            server.stop()


class ServerPool:
    """The shared servers of a module, one at a time: `get(key, config)` answers the running
    server if it was started for `key`, else stops it and starts one for `key` on a new data
    folder (with the test model linked in), whose configuration is `config(data_dir)`. Tests
    that need a different configuration (a `token_delay`, say) name a different key."""

    def __init__(
        self,
        tmp_path_factory: pytest.TempPathFactory,
        test_model_dir: Path,
        env: Callable[[Path], dict[str, str]] | None = None,
    ) -> None:
        self.tmp_path_factory = tmp_path_factory
        self.test_model_dir = test_model_dir
        self.env = env
        self.key: Hashable = None
        self.server: SharedServer | None = None
        self._stack = ExitStack()

    def get(self, key: Hashable, config: Callable[[Path], dict[str, Any]]) -> SharedServer:
        if self.server is None or key != self.key:
            self.close()
            root = self.tmp_path_factory.mktemp("shared-jp")
            data_dir = root / "lmsp"
            data_dir.mkdir()
            with_test_model(data_dir, self.test_model_dir)
            env = self.env(data_dir) if self.env else None
            self.server = self._stack.enter_context(
                shared_server(config(data_dir), root / "jupyter", env)
            )
            self.server.data_dir = data_dir
            self.key = key
        return self.server

    def close(self) -> None:
        self.server = None
        self._stack.close()
        self._stack = ExitStack()

    def __enter__(self) -> ServerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
