"""OpenAI-style error bodies: {"error": {"message", "type", "param", "code"}} with the matching HTTP status.

The shape is vLLM's own (`ErrorResponse`): `type` is the OpenAI client's exception name for the
status and `code` repeats the status, so OpenAI SDKs raise the usual exception classes.
"""

from __future__ import annotations

from aiohttp import web

from fleet.core.errors import KvfleetError

TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError", 404: "NotFoundError",
         405: "MethodNotAllowedError", 408: "RequestTimeoutError", 413: "RequestTooLargeError", 415: "UnsupportedMediaTypeError",
         429: "RateLimitError", 500: "InternalServerError", 502: "BadGatewayError", 503: "ServiceUnavailableError",
         504: "GatewayTimeoutError"}

# fleet.core.errors code (gRPC status name) -> HTTP status
STATUS_OF_CODE = {"INVALID_ARGUMENT": 400, "UNAUTHENTICATED": 401, "PERMISSION_DENIED": 403, "NOT_FOUND": 404,
                  "ALREADY_EXISTS": 409, "FAILED_PRECONDITION": 400, "RESOURCE_EXHAUSTED": 429,
                  "UNAVAILABLE": 503}


class ProxyError(Exception):
    """An error the proxy answers itself, with an HTTP status and a message a person can act on."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def from_fleet(e: KvfleetError) -> ProxyError:
    """A controller error (fleet.core.errors.*) as the HTTP status of its gRPC code."""
    return ProxyError(STATUS_OF_CODE.get(e.code, 500), f"controller: {e}")


def error_body(status: int, message: str, param: str | None = None) -> dict[str, object]:
    return {"error": {"message": message, "type": TYPES.get(status, "APIError"), "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None) -> web.Response:
    headers = {"Retry-After": "1"} if status in (429, 503) else None
    return web.json_response(error_body(status, message, param), status=status, headers=headers)
