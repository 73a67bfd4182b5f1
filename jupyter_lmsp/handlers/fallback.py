"""The last route under `lmsp/v1/`: any path no other route matches gets LMSP's 404.

Without it, Jupyter Server answers such paths (an unknown endpoint, or an id with characters no
id has) with its HTML "404: Not Found" page, which an API client cannot read as an error.
"""

from __future__ import annotations

from ..protocol.errors import LMSPError
from .base import LMSPHandler


class FallbackHandler(LMSPHandler):
    def check_xsrf_cookie(self) -> None:
        # Nothing here acts on anyone's behalf, so there is nothing to forge.
        return None

    # Async, as Jupyter's own APIHandler.prepare (which overrides Tornado's the same way).
    async def prepare(self) -> None:  # type: ignore[override]
        # The size limit holds here too: the body is refused, never read.
        self._check_declared_size()
        raise LMSPError(
            404,
            "not_found",
            f"There is no endpoint at '{self.request.path}'.",
            type="not_found_error",
        )
