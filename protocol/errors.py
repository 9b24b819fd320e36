"""OpenAI's error shape, `{"error": {"message", "type", "param", "code"}}`, plus Retry-After.

Every surface (engine server, gateway) answers every rejection with an `ApiError`; the shared
aiohttp middleware in `protocol.http` turns it into this JSON.
"""

from __future__ import annotations

import math
from typing import Any

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    502: "api_error",
    503: "service_unavailable",
    504: "timeout_error",
}


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


def error_body(message: str, type_: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class ApiError(Exception):
    """A request answered with an error; `retry_after` (seconds) adds a Retry-After header."""

    def __init__(self, status: int, message: str, *, code: str | None = None,
                 param: str | None = None, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.retry_after = retry_after

    @property
    def type(self) -> str:
        return error_type(self.status)

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def headers(self) -> dict[str, str]:
        if self.retry_after is None:
            return {}
        return {"Retry-After": str(retry_after_header(self.retry_after))}


def retry_after_header(seconds: float) -> int:
    """Whole seconds, rounded up and at least 1: Retry-After has no fractions and 0 invites a
    client to hammer the server."""
    return max(1, math.ceil(seconds))


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, code=code, param=param)
