"""`/lmsp/v1/openapi.json`: the service's OpenAPI 3.1 document (LMSP B1).

Served without credentials, like most published API descriptions: it says how to call the
service, not what it holds. Its `servers` entry is this server's own mount point. The document
is generated once per mount point from the route table (handlers/routes.py).
"""

from __future__ import annotations

import functools
from typing import Any

from ..protocol.openapi import openapi_document
from ..protocol.operations import Reply
from .base import LMSPHandler, operation


@functools.cache
def document(server_url: str, version: str) -> dict[str, Any]:
    from .routes import endpoints, path_extensions  # the table names this handler too

    return openapi_document(endpoints(), server_url, version, path_extensions())


class OpenAPIHandler(LMSPHandler):
    @operation(
        "getOpenAPI",
        "This document",
        "service",
        access="public",
        replies={200: Reply("The OpenAPI 3.1 document.", schema={"type": "object"})},
    )
    async def get(self) -> None:
        self.set_header("Cache-Control", "no-cache")
        self.write_json(document(self.api_prefix, self.ctx.version))


def main() -> None:
    """`python -m jupyter_lmsp.handlers.openapi`: the document (mounted at `/lmsp/v1`) on
    stdout, as `make types` writes it to labextension/openapi.json for the sidebar's types."""
    import json
    import sys

    from .._version import __version__

    json.dump(document("/lmsp/v1", __version__), sys.stdout, indent=2, sort_keys=False)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
