"""`/lmsp/v1/metrics`: the LMSP metrics in the Prometheus text format, for callers with the
`metrics:read` scope (docs/metrics.md). Jupyter Server serves the same metrics, beside its own,
at `/metrics`."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST

from ..protocol.operations import Reply
from ..services import metrics
from .base import LMSPHandler, operation


class MetricsHandler(LMSPHandler):
    @operation(
        "getMetrics",
        "The service's Prometheus metrics",
        "service",
        access="metrics:read",
        replies={
            200: Reply(
                "Every LMSP metric (docs/metrics.md), in the Prometheus text format 0.0.4.",
                text="text/plain",
            )
        },
        description="The gauges read from the database (`lmsp_tasks`) are read for this "
        "answer; every other metric counts what this server did since it started.",
    )
    async def get(self) -> None:
        await self.call(metrics.refresh_from_db, self.ctx.db)
        self.finish(metrics.exposition(), set_content_type=CONTENT_TYPE_LATEST)
