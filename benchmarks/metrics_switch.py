"""A Jupyter Server extension for `bench_metrics.py --switch` only: turns LMSP's metrics on or off
in a running server, so one server can serve blocks of both modes, alternating.

    POST /lmsp-bench/metrics  body `on` or `off`  → 204

It calls what `LMSPExtension.metrics` calls at start-up (`metrics.set_enabled`): every record,
and the refresh of the gauges read from the database, is then a no-op or not. Loaded with
`--ServerApp.jpserver_extensions=metrics_switch=True` and `benchmarks/` on `PYTHONPATH`; never
part of the package. Only the server's own user may call it (Jupyter's token).
"""

from __future__ import annotations

from typing import Any

from jupyter_server.base.handlers import APIHandler
from tornado import web

from jupyter_lmsp.services import metrics

PATH = "/lmsp-bench/metrics"


class MetricsSwitchHandler(APIHandler):
    @web.authenticated
    def post(self) -> None:
        wanted = self.request.body.decode().strip()
        if wanted not in ("on", "off"):
            raise web.HTTPError(400, "the body is 'on' or 'off'")
        metrics.set_enabled(wanted == "on")
        self.set_status(204)
        self.finish()


def _jupyter_server_extension_points() -> list[dict[str, Any]]:
    return [{"module": "metrics_switch"}]


def _load_jupyter_server_extension(serverapp: Any) -> None:
    base = serverapp.web_app.settings["base_url"].rstrip("/")
    serverapp.web_app.add_handlers(".*$", [(base + PATH, MetricsSwitchHandler)])
