"""LMSP errors: one exception type that carries status, type, code and message (LMSP B1).

Every error the service reports, from any layer, is an `LMSPError`; handlers turn it into the
`{"error": {...}}` body. Constructors below name the common cases so call sites read as prose.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class ErrorDetail(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: str = Field(examples=["invalid_request_error", "not_found_error"])
    code: str
    message: str
    param: str | None


class Error(BaseModel):
    """Every error the service answers with (LMSP B1)."""

    model_config = ConfigDict(extra="forbid", json_schema_serialization_defaults_required=True)
    error: ErrorDetail


class LMSPError(Exception):
    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.type = type
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "type": self.type,
                "code": self.code,
                "message": self.message,
                "param": self.param,
            }
        }


def invalid(message: str, param: str | None = None, code: str = "invalid_value") -> LMSPError:
    return LMSPError(400, code, message, param=param)


def not_found(what: str, ident: str, param: str | None = None) -> LMSPError:
    return LMSPError(
        404, "not_found", f"No {what} with id '{ident}' found.", type="not_found_error", param=param
    )


def conflict(code: str, message: str, retry_after: int | None = None) -> LMSPError:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return LMSPError(409, code, message, type="conflict_error", headers=headers)


def unauthenticated(message: str = "Missing or invalid credentials.") -> LMSPError:
    return LMSPError(
        401,
        "invalid_token",
        message,
        type="authentication_error",
        headers={"WWW-Authenticate": 'Bearer realm="lmsp"'},
    )


def insufficient_scope(scope: str) -> LMSPError:
    return LMSPError(
        403,
        "insufficient_scope",
        f"This token lacks the '{scope}' scope.",
        type="permission_error",
        headers={
            "WWW-Authenticate": f'Bearer realm="lmsp", error="insufficient_scope", scope="{scope}"'
        },
    )


def too_large(limit: int) -> LMSPError:
    return LMSPError(
        413, "request_too_large", f"The request body exceeds the limit of {limit} bytes."
    )
