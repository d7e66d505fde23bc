"""AsyncFleetClient: the asyncio kvfleet SDK, same surface as FleetClient with coroutines.

Its calls are the rows of fleet/sdk/table.py, run by `aio`; FleetClient runs the same rows.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, ClassVar, Concatenate, ParamSpec, TypeVar

import grpc

from fleet.core.errors import FailedPrecondition
from fleet.sdk import aio_status, base, failures
from fleet.sdk import table as t
from fleet.sdk.failures import Sent
from fleet.sdk.retry import Attempts, retryable

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")


class AsyncTransport(base.Transport):
    """Runs a table row on a grpc.aio channel: one attempt, or retries under the client's RetryPolicy."""

    _grpc: ClassVar[Any] = grpc.aio
    _lazy: ClassVar[bool] = True  # NOTE: a grpc.aio channel binds the event loop it is made in: made in __init__,
    # outside asyncio.run (a module-level client), every call raised a raw RuntimeError ("attached to a different
    # loop"); now it is made at the first call, in that call's loop
    _loop: asyncio.AbstractEventLoop | None = None  # the event loop of the first call

    def _check_loop(self) -> None:
        """FailedPrecondition for a call from an event loop other than the first call's (grpc.aio serves one)."""
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif loop is not self._loop:
            raise FailedPrecondition(f"AsyncFleetClient of {self.target} serves the event loop of its first call, "
                                     "and this call runs in another (a second asyncio.run?): a grpc.aio channel "
                                     "works in one loop only; make one client per event loop")

    async def _call(self, method: str, fn: Callable[[float], Awaitable[T]], timeout: float | None = None,
                    sent: Sent | None = None) -> T:
        """Await fn(per-attempt timeout), retrying UNAVAILABLE (and, for a call with an op id, DEADLINE_EXCEEDED)
        with backoff until the retry deadline; `sent`: the call as its error names it (default: a unary call of
        `method` with `timeout`)."""
        sent = sent or self._sent(method, timeout)
        tries = Attempts(self.retry)
        while (given := tries.next(sent.per_attempt)) is not None:
            try:
                return await fn(given)
            except grpc.RpcError as e:
                if not retryable(e, keyed=bool(sent.op_id)):
                    raise failures.failed(e, sent, given, tries.num_attempts) from e
                pause = tries.failed(e)
                if pause is not None:  # never past the deadline
                    await asyncio.sleep(pause)
        raise failures.exhausted(sent, tries)

    async def _send(self, rpc: t.Rpc[..., Any], req: Any) -> Any:
        try:
            return await self._send_open(rpc, req)
        except asyncio.CancelledError:
            # NOTE: grpc.aio ends the calls in flight on its channel's close() with CancelledError: a call whose
            # client another task closed raised it into a task nobody cancelled (found by review). A task that is
            # being cancelled (cancelling()) stays cancelled.
            task = asyncio.current_task()
            if not self._closed or task is None or task.cancelling():
                raise
            raise self._closed_in_flight(req.op_id if rpc.keyed else "") from None
        except Exception as e:
            self._raced_close(e)
            raise

    async def _send_open(self, rpc: t.Rpc[..., Any], req: Any) -> Any:
        self._check_open()
        self._check_loop()
        stub_method, per = self._methods.get(id(rpc)) or self._stub_method(rpc)

        async def attempt(timeout: float) -> Any:
            reply = stub_method(req if rpc.wire is None else rpc.wire(req), timeout=timeout, metadata=self._md)
            if rpc.streaming == "client":
                return await aio_status.awaited(reply)
            return await reply if rpc.each is None else [rpc.each(m) async for m in reply]

        sent = self._sent(rpc.method, per, rpc.timeout, req.op_id if rpc.keyed else "")
        if rpc.retry:
            return await self._call(rpc.method, attempt, per, sent)
        try:
            return await attempt(per)
        except grpc.RpcError as e:
            raise failures.failed(e, sent, per) from e


def aio(rpc: t.Rpc[P, R]) -> Callable[Concatenate[AsyncTransport, P], Coroutine[Any, Any, R]]:
    """The coroutine client method that runs `rpc`."""
    async def call(self: AsyncTransport, /, *args: P.args, **kwargs: P.kwargs) -> R:
        req = rpc.build(*args, **kwargs)
        return rpc.response(await self._send(rpc, req), req)
    return rpc.method_of(call)


class AsyncFleetClient(AsyncTransport):
    """asyncio client of a kvfleet controller (arguments as FleetClient). Use `async with` or `await close()`.

    It may be made anywhere (its channel is made at the first call) and serves the event loop of its first call:
    a call from another loop raises FailedPrecondition; make one client per loop."""

    # blobs
    put_blob = aio(t.PUT_BLOB)
    get_blob = aio(t.GET_BLOB)
    stat_blob = aio(t.STAT_BLOB)
    pin_blob = aio(t.PIN_BLOB)
    unpin_blob = aio(t.UNPIN_BLOB)
    collect_garbage = aio(t.COLLECT_GARBAGE)
    # workers (operator)
    register_worker = aio(t.REGISTER_WORKER)
    unregister_worker = aio(t.UNREGISTER_WORKER)
    workers = aio(t.WORKERS)
    lifecycle = aio(t.LIFECYCLE)
    # routing, fleet
    route = aio(t.ROUTE)
    whoami = aio(t.WHOAMI)
    fleet = aio(t.FLEET)
    # sessions (the tenant is the token's)
    create_session = aio(t.CREATE_SESSION)
    append = aio(t.APPEND)
    add_tool_result = aio(t.ADD_TOOL_RESULT)
    generate = aio(t.GENERATE)
    evict = aio(t.EVICT)
    fork = aio(t.FORK)
    admit_tool_result = aio(t.ADMIT_TOOL_RESULT)
    working_set = aio(t.WORKING_SET)
    get_session = aio(t.GET_SESSION)
    close_session = aio(t.CLOSE_SESSION)
    fleet_sessions = aio(t.FLEET_SESSIONS)
    sessions = aio(t.SESSIONS)
    # quarantine verdicts on tool results (set_verdict: operator)
    judge_tool_results = aio(t.JUDGE_TOOL_RESULTS)
    set_verdict = aio(t.SET_VERDICT)
    list_quarantines = aio(t.LIST_QUARANTINES)

    async def close(self) -> None:
        """Close the channel. Idempotent; every call after it raises FailedPrecondition. Outside the channel's
        own event loop or process (a fork) it only marks the client closed: the channel cannot be closed there."""
        if self._mark_closed() and self._channel is not None and not self._forked() and self._in_own_loop():
            await self._channel.close()

    def _in_own_loop(self) -> bool:
        return self._loop is None or self._loop is asyncio.get_running_loop()

    async def __aenter__(self) -> AsyncFleetClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
