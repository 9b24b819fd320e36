"""OpenAI's error shape: `{"error": {"message", "type", "param", "code"}}`, plus Retry-After.

Every rejection the gateway makes is an `ApiError`; the error middleware turns it (and anything
unexpected) into this JSON, so a client never sees an HTML page or a bare 500 traceback.
"""

from __future__ import annotations

import math

from aiohttp import web

_TYPES = {
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


class ApiError(Exception):
    """A request the gateway answers with an error; `retry_after` (seconds) adds Retry-After."""

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
        return _TYPES.get(self.status, "api_error")

    def body(self) -> dict[str, object]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def headers(self) -> dict[str, str]:
        if self.retry_after is None:
            return {}
        return {"Retry-After": str(retry_after_header(self.retry_after))}

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status, headers=self.headers())


def retry_after_header(seconds: float) -> int:
    """Whole seconds, rounded up and at least 1: Retry-After has no fractions and 0 invites a
    client to hammer the gateway."""
    return max(1, math.ceil(seconds))


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, code=code, param=param)
