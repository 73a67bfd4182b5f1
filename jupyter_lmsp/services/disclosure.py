"""What of the host a caller may see (docs/security.md): the owner everything, a paired client
no host path. Models are shown without paths by `protocol.objects.model_object(host_paths=)`;
the service's own report goes through here.
"""

from __future__ import annotations

from typing import Any

from ..auth.scopes import Caller


def blas_report(report: dict[str, Any] | None, caller: Caller) -> dict[str, Any] | None:
    """`GET /service`'s `blas` object: its `paths` (the BLAS libraries' files) only for the
    owner."""
    if report is None or caller.is_owner:
        return report
    return {key: value for key, value in report.items() if key != "paths"}
