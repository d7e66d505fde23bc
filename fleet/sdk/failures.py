"""What a failed SDK call raises: a gRPC status as the fleet.core.errors class of its code, with a message that
says what to do (fleet/sdk/base.py re-exports these names; the proxy uses them too).

A call that carries an op id (append, add_tool_result, generate) raises its error with that `op_id` set on it: an
UNAVAILABLE or a deadline leaves the op possibly applied, and a call with the same op id is answered from the
session's op log (replayed=True) instead of being applied twice.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import grpc

from fleet.core import errors
from fleet.core.errors import KvfleetError, Unavailable
from fleet.sdk.retry import Attempts, tls_failure

_BY_CODE = {c.code: c for c in (errors.InvalidArgument, errors.NotFound, errors.AlreadyExists, errors.FailedPrecondition,
                                errors.ResourceExhausted, errors.Unavailable, errors.Unauthenticated,
                                errors.PermissionDenied)}


@dataclass(frozen=True, slots=True)
class Sent:
    """One call, as its error names it: the RPC, the controller, the per-attempt deadline and the client setting
    that sets it ("timeout", "blob_timeout", "session_timeout"), the retry policy's deadline_s and the op id the
    call carries ("" for none)."""

    method: str
    target: str
    per_attempt: float
    setting: str
    deadline_s: float
    op_id: str = ""


def to_error(e: grpc.RpcError, method: str, target: str) -> KvfleetError:
    """A gRPC status as the fleet.core.errors class of the same code, carrying the server's message; an
    UNAVAILABLE no controller answered (`answered`) says the controller at `target` is unreachable, or that the TLS
    handshake with it failed (retry.tls_failure)."""
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    details = (e.details() if hasattr(e, "details") else None) or str(e)
    if code == grpc.StatusCode.UNAVAILABLE and not answered(e):
        if (cause := tls_failure(details)) is not None:
            return Unavailable(f"{method}: the controller at {target} did not complete a TLS handshake ({cause}); "
                               f"grpc: {details}")
        return Unavailable(f"{method}: the controller at {target} is unreachable ({details})")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and not answered(e) and (big := too_large(details, method, target)):
        return big
    return error_of(code.name, details, method, target)


_TOO_LARGE = re.compile(r"^(SERVER|CLIENT)?:? ?Received message larger than max \((\d+) vs\. (\d+)\)")


def too_large(details: str, method: str, target: str) -> errors.ResourceExhausted | None:
    """gRPC's own refusal of a message past a side's receive limit, said as what to do. NOTE: before, a 5 MiB append
    raised ResourceExhausted "SERVER: Received message larger than max (5242936 vs. 4194304)", naming neither the
    call nor the limit's flag (found by review)."""
    m = _TOO_LARGE.match(details)
    if m is None:
        return None
    side, size, limit = m.group(1), int(m.group(2)), int(m.group(3))
    if side == "CLIENT":
        return errors.ResourceExhausted(
            f"{method}: the answer from the controller at {target} is {size:,} bytes, over this client's limit of "
            f"{limit:,} (grpc.max_receive_message_length in the client's options); ask for less, or raise it")
    return errors.ResourceExhausted(
        f"{method}: the request is {size:,} bytes, over the controller's limit of {limit:,} bytes per message "
        f"(its --grpc-max-receive-bytes) at {target}; send less in one call (a shorter text or fewer token ids), "
        "or raise the limit")


def error_of(code: str, details: str, method: str, target: str) -> KvfleetError:
    """A status code's name and message (a gRPC status, or a RouteStream answer's error) as that class."""
    if code == "DEADLINE_EXCEEDED":
        return Unavailable(f"{method} at {target}: deadline exceeded ({details}); the controller is slow or "
                           "unreachable, raise the client's timeout (session calls: session_timeout; blobs: blob_timeout) "
                           "or check the controller")
    cls = _BY_CODE.get(code)
    if cls is not None:
        return cls(details)
    err = KvfleetError(f"{method} at {target}: {code}: {details}")
    err.code = code
    return err


def answered(e: BaseException | None) -> bool:
    """True when the controller itself answered this status (it marks each error it answers with
    fleet.core.errors.ANSWERED_TRAILER); False for a connection-level failure, which no controller answered."""
    trailing = e.trailing_metadata() if isinstance(e, grpc.RpcError) and hasattr(e, "trailing_metadata") else None
    return any(key == errors.ANSWERED_TRAILER for key, _ in trailing or ())


def gave_up(method: str, target: str, attempts: int, elapsed: float, last: BaseException | None) -> Unavailable:
    """The error after the last retry. NOTE: "check that the controller is running" is said only when no controller
    answered: it was said after UNAVAILABLEs the controller answered too (no serving worker, a standby), which sent
    the user looking for a problem it did not have (found by review)."""
    last_msg = last.details() if isinstance(last, grpc.RpcError) and hasattr(last, "details") else str(last)
    if answered(last):
        return Unavailable(f"{method}: the controller at {target} answered UNAVAILABLE to {attempts} attempt(s) "
                           f"over {elapsed:.1f}s: {last_msg}")
    return Unavailable(f"{method}: controller at {target} unavailable after {attempts} attempt(s) over {elapsed:.1f}s "
                       f"(last error: {last_msg}); check that `kvfleet controller` is running and reachable")


def timed_out(e: BaseException | None) -> bool:
    return isinstance(e, grpc.RpcError) and hasattr(e, "code") and e.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def deadline_error(sent: Sent, timeout: float, attempts: int = 1) -> Unavailable:
    """DEADLINE_EXCEEDED on an attempt that had `timeout` seconds, naming the setting that cut it: the per-attempt
    one when the attempt had all of it, else the retry policy's deadline_s (a retry runs only until it).

    NOTE: before, the message always said to raise the per-attempt setting, which changed nothing for a retried
    session call: the retry deadline (30 s) cut it first (found by review)."""
    cut = (f"raise the client's {sent.setting} (per attempt: {sent.per_attempt:g}s)" if timeout >= sent.per_attempt
           else f"this retry had only what was left of RetryPolicy.deadline_s ({sent.deadline_s:g}s from the call's "
                "first attempt): raise deadline_s")
    tries = f" (attempt {attempts})" if attempts > 1 else ""
    return Unavailable(f"{sent.method} at {sent.target}: deadline exceeded after {timeout:.1f}s{tries}; the controller "
                       f"is slow or unreachable: {cut}, or check the controller")


def with_op_id(err: KvfleetError, op_id: str) -> KvfleetError:
    """`err` with the call's op id set on it (`err.op_id`); an Unavailable (a deadline, a lost answer, a torn
    session) also says the op may have been applied and how to finish it without applying it twice."""
    if not op_id:
        return err
    # NOTE: not where the controller's message already names the retry (a session call its kernel host did not answer
    # in time: workers/call_timeout.py); the advice came twice
    if isinstance(err, Unavailable) and f"op_id {op_id!r}" not in str(err):
        err = Unavailable(f"{err}. The op may have been applied: call again with op_id={op_id!r} (the error's "
                          "op_id) and it is answered from the session's op log (replayed=True), never applied twice")
    err.op_id = op_id
    return err


def failed(e: grpc.RpcError, sent: Sent, timeout: float, attempts: int = 1) -> KvfleetError:
    """The error of an attempt that is not retried, that had `timeout` seconds."""
    err = deadline_error(sent, timeout, attempts) if timed_out(e) else to_error(e, sent.method, sent.target)
    return with_op_id(err, sent.op_id)


def exhausted(sent: Sent, tries: Attempts) -> KvfleetError:
    """The error after the last retry (UNAVAILABLE: gave_up)."""
    if timed_out(tries.last):
        err: KvfleetError = deadline_error(sent, tries.timeout, tries.num_attempts)
    else:
        err = gave_up(sent.method, sent.target, tries.num_attempts, tries.elapsed(), tries.last)
    return with_op_id(err, sent.op_id)
