"""FleetClient: the synchronous kvfleet SDK (typed results, deadlines, retries on UNAVAILABLE).

Its calls are the rows of fleet/sdk/table.py, run by `sync`; AsyncFleetClient runs the same rows.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, TypeVar

import grpc

from fleet.sdk import base, failures
from fleet.sdk import table as t
from fleet.sdk.failures import Sent
from fleet.sdk.retry import Attempts, retryable

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")


class SyncTransport(base.Transport):
    """Runs a table row on a blocking channel: one attempt, or retries under the client's RetryPolicy."""

    def _call(self, method: str, fn: Callable[[float], T], timeout: float | None = None,
              sent: Sent | None = None) -> T:
        """Run fn(per-attempt timeout), retrying UNAVAILABLE (and, for a call with an op id, DEADLINE_EXCEEDED)
        with backoff until the retry deadline; `sent`: the call as its error names it (default: a unary call of
        `method` with `timeout`)."""
        sent = sent or self._sent(method, timeout)
        tries = Attempts(self.retry)
        while (given := tries.next(sent.per_attempt)) is not None:
            try:
                return fn(given)
            except grpc.RpcError as e:
                if not retryable(e, keyed=bool(sent.op_id)):
                    raise failures.failed(e, sent, given, tries.num_attempts) from e
                pause = tries.failed(e)
                if pause is not None:  # never past the deadline
                    time.sleep(pause)
        raise failures.exhausted(sent, tries)

    def _send(self, rpc: t.Rpc[..., Any], req: Any) -> Any:
        try:
            return self._send_open(rpc, req)
        except Exception as e:
            self._raced_close(e)
            raise

    def _send_open(self, rpc: t.Rpc[..., Any], req: Any) -> Any:
        self._check_open()
        stub_method, per = self._methods.get(id(rpc)) or self._stub_method(rpc)

        def attempt(timeout: float) -> Any:
            reply = stub_method(req if rpc.wire is None else rpc.wire(req), timeout=timeout, metadata=self._md)
            return reply if rpc.each is None else [rpc.each(m) for m in reply]

        sent = self._sent(rpc.method, per, rpc.timeout, req.op_id if rpc.keyed else "")
        if rpc.retry:
            return self._call(rpc.method, attempt, per, sent)
        try:
            return attempt(per)
        except grpc.RpcError as e:
            raise failures.failed(e, sent, per) from e


def sync(rpc: t.Rpc[P, R]) -> Callable[Concatenate[SyncTransport, P], R]:
    """The blocking client method that runs `rpc`."""
    def call(self: SyncTransport, /, *args: P.args, **kwargs: P.kwargs) -> R:
        req = rpc.build(*args, **kwargs)
        return rpc.response(self._send(rpc, req), req)
    return rpc.method_of(call)


class FleetClient(SyncTransport):
    """Synchronous client of a kvfleet controller.

    Args:
        target: "host:port" of the controller.
        token: bearer token (from `kvfleet controller --mint-token`); None if auth is off.
        tls: use TLS (system roots unless root_certificates is given).
        root_certificates: CA bundle (PEM bytes or a path) that signed the controller's certificate.
        client_cert, client_key: this client's certificate and key (PEM bytes or paths), for a controller
            that requires mutual TLS (--tls-client-ca).
        timeout: per-attempt deadline of unary calls, seconds (the first attempt has all of it; a retry ends
            at the retry policy's deadline_s, counted from the call's start).
        blob_timeout: per-attempt deadline of a blob put or get, seconds.
        retry: backoff policy for UNAVAILABLE (and DEADLINE_EXCEEDED of a call that carries an op id: append,
            add_tool_result, generate; its error carries the op id as `e.op_id`).
        options: gRPC channel options.
        session_timeout: per-attempt deadline of a session call, seconds (120 by default: a fork or a
            regeneration replays a whole op log).
    """

    # blobs
    put_blob = sync(t.PUT_BLOB)
    get_blob = sync(t.GET_BLOB)
    stat_blob = sync(t.STAT_BLOB)
    pin_blob = sync(t.PIN_BLOB)
    unpin_blob = sync(t.UNPIN_BLOB)
    collect_garbage = sync(t.COLLECT_GARBAGE)
    # workers (operator)
    register_worker = sync(t.REGISTER_WORKER)
    unregister_worker = sync(t.UNREGISTER_WORKER)
    workers = sync(t.WORKERS)
    lifecycle = sync(t.LIFECYCLE)
    # routing, fleet
    route = sync(t.ROUTE)
    whoami = sync(t.WHOAMI)
    fleet = sync(t.FLEET)
    # sessions (the tenant is the token's)
    create_session = sync(t.CREATE_SESSION)
    append = sync(t.APPEND)
    add_tool_result = sync(t.ADD_TOOL_RESULT)
    generate = sync(t.GENERATE)
    evict = sync(t.EVICT)
    fork = sync(t.FORK)
    admit_tool_result = sync(t.ADMIT_TOOL_RESULT)
    working_set = sync(t.WORKING_SET)
    get_session = sync(t.GET_SESSION)
    close_session = sync(t.CLOSE_SESSION)
    fleet_sessions = sync(t.FLEET_SESSIONS)
    sessions = sync(t.SESSIONS)
    # quarantine verdicts on tool results (set_verdict: operator)
    judge_tool_results = sync(t.JUDGE_TOOL_RESULTS)
    set_verdict = sync(t.SET_VERDICT)
    list_quarantines = sync(t.LIST_QUARANTINES)

    def close(self) -> None:
        """Close the channel. Idempotent; every call after it raises FailedPrecondition. In a forked child
        it only marks the client closed: the channel is the parent's."""
        if self._mark_closed() and not self._forked():
            self._channel.close()

    def __enter__(self) -> FleetClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

