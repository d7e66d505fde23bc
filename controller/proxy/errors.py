"""OpenAI-style error bodies: {"error": {"message", "type", "param", "code"}} with the matching HTTP status.

The shape is vLLM's own (`ErrorResponse`): `type` is the OpenAI client's exception name for the
status and `code` repeats the status, so OpenAI SDKs raise the usual exception classes.
"""

from __future__ import annotations

import logging

from aiohttp import web

from fleet.core.errors import KvfleetError

log = logging.getLogger("kvfleet.proxy")
_last_logged = ""  # the last controller-link error from_fleet logged

TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError", 404: "NotFoundError",
         405: "MethodNotAllowedError", 408: "RequestTimeoutError", 409: "ConflictError", 413: "RequestTooLargeError",
         415: "UnsupportedMediaTypeError",
         429: "RateLimitError", 500: "InternalServerError", 502: "BadGatewayError", 503: "ServiceUnavailableError",
         504: "GatewayTimeoutError"}

# fleet.core.errors code (gRPC status name) -> HTTP status
STATUS_OF_CODE = {"INVALID_ARGUMENT": 400, "UNAUTHENTICATED": 401, "PERMISSION_DENIED": 403, "NOT_FOUND": 404,
                  "ALREADY_EXISTS": 409, "FAILED_PRECONDITION": 400, "RESOURCE_EXHAUSTED": 429,
                  "UNAVAILABLE": 503}


class ProxyError(Exception):
    """An error the proxy answers itself, with an HTTP status and a message a person can act on."""

    def __init__(self, status: int, message: str, param: str | None = None, err_type: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.err_type = err_type  # None: the OpenAI client's exception name for the status (TYPES)


def from_fleet(e: KvfleetError, controller: str) -> ProxyError:
    """A controller error (fleet.core.errors.*) as the HTTP status of its gRPC code. `controller`: the controller's
    address. An error that names it was worded by the proxy's gRPC client (fleet.sdk.base, route_stream.py): the
    controller unreachable or too slow, or a status with no class of its own (INTERNAL, UNKNOWN: any text). The
    client is told what happened and which call (the message's first word); the address and the rest go to the log.
    NOTE: every client got them (found by review); the controller's own messages are worded for its clients.
    An error the proxy raised itself (`local`: its bodies' budget, its own slots) is answered as it is worded.
    NOTE: those got the "controller: " prefix too: a 429 for the proxy's --max-inflight-bytes-per-tenant read as the
    controller's (found with the official OpenAI client)."""
    status, text = STATUS_OF_CODE.get(e.code, 500), str(e)
    if getattr(e, "local", False):
        return ProxyError(status, text)
    if controller not in text:
        return ProxyError(status, f"controller: {text}")
    global _last_logged
    if text != _last_logged:  # NOTE: once per new message: a dead controller fails every request alike
        log.warning("proxy: %s", text)
        _last_logged = text
    call = text.split(maxsplit=1)[0].rstrip(":")  # "Route: the controller at ...", "JudgeToolResults at ..."
    if status == 503:
        return ProxyError(503, f"the controller is unreachable, or did not answer the proxy's {call} call in time; "
                               "retry shortly")
    return ProxyError(status, f"the controller failed the proxy's {call} call ({e.code}); the proxy's log has more")


def error_body(status: int, message: str, param: str | None = None, err_type: str | None = None) -> dict[str, object]:
    return {"error": {"message": message, "type": err_type or TYPES.get(status, "APIError"), "param": param,
                      "code": status}}


def error_response(status: int, message: str, param: str | None = None, err_type: str | None = None) -> web.Response:
    return web.json_response(error_body(status, message, param, err_type), status=status,
                             headers=_retry_headers(status))


def _retry_headers(status: int) -> dict[str, str] | None:
    """What tells a client whether to retry: Retry-After on a 429 or 503 (the OpenAI SDKs wait that long), and
    `x-should-retry: false` on a 409.
    NOTE: the OpenAI SDKs retry a 409 by default (an API's lock timeout); the proxy's 409s are final (a stored
    conversation with a tool result quarantined since: the client must resend it; the controller's ALREADY_EXISTS),
    and the official Python client sent the same refused request three times, each asking the controller again."""
    if status in (429, 503):
        return {"Retry-After": "1"}
    if status == 409:
        return {"x-should-retry": "false"}
    return None
