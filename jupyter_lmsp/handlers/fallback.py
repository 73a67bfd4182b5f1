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
        # The size limit holds here too: a larger body is refused, never read.
        self._check_declared_size()
        if self.request.method == "OPTIONS":
            # Jupyter's (CORS preflight) would otherwise answer for a path that does not exist.
            raise self.not_found()
        # The 404 is answered once the body (within the limit) has arrived, dropped unread.
        self._deferred_error = self.not_found()

    def not_found(self) -> LMSPError:
        return LMSPError(
            404,
            "not_found",
            f"There is no endpoint at '{self.request.path}'.",
            type="not_found_error",
        )

    # Answered from the method, after the body: the connection stays open.
    async def get(self, *_: str) -> None:
        raise self.not_found()

    post = put = patch = delete = head = get
