"""`/lmsp/v1/openapi.json`: the service's OpenAPI 3.1 document (LMSP B1).

Served without credentials, like most published API descriptions: it says how to call the
service, not what it holds. Its `servers` entry is this server's own mount point.
"""

from __future__ import annotations

from ..protocol.openapi import openapi_document
from .base import LMSPHandler, allow_unauthenticated, public


class OpenAPIHandler(LMSPHandler):
    @allow_unauthenticated
    @public
    def get(self) -> None:
        self.set_header("Cache-Control", "no-cache")
        self.write_json(openapi_document(self.api_prefix, version=self.ctx.version))
