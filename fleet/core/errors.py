"""Domain errors shared by the core and the shells.

Every error carries a `code` naming the gRPC status it maps to, so servicers translate without a
table of special cases, and a message a person can act on (what was wrong, what to do instead).
The core raises these; it never imports grpc.
"""

from __future__ import annotations

# The trailing-metadata key the controller sets on every error status it answers (its value: the code's name), so
# a client tells an UNAVAILABLE the controller answered from one no controller answered (connection refused, a
# TLS handshake, a proxy in between): only the latter earns "check that the controller is running".
ANSWERED_TRAILER = "kvfleet-error"


class KvfleetError(Exception):
    """Base class. `code` is the name of a grpc.StatusCode member; `op_id` the op id of the session call that failed,
    where the call carried one (the SDK sets it: a retry under it is never applied twice), else ""."""

    code = "INTERNAL"
    op_id = ""


class InvalidArgument(KvfleetError, ValueError):
    code = "INVALID_ARGUMENT"


class NotFound(KvfleetError, KeyError):
    code = "NOT_FOUND"

    def __str__(self) -> str:  # KeyError quotes its message; we want it plain
        return str(self.args[0]) if self.args else "not found"


class AlreadyExists(KvfleetError):
    code = "ALREADY_EXISTS"


class FailedPrecondition(KvfleetError):
    code = "FAILED_PRECONDITION"


class ResourceExhausted(KvfleetError):
    code = "RESOURCE_EXHAUSTED"


class Unavailable(KvfleetError):
    code = "UNAVAILABLE"


class Unauthenticated(KvfleetError):
    code = "UNAUTHENTICATED"


class PermissionDenied(KvfleetError):
    code = "PERMISSION_DENIED"
