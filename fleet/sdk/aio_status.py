"""The status a grpc.aio client-streaming call really ended with.

NOTE: grpc.aio (1.85 and earlier) sets a client-streaming call's status twice when the server ends the call while
a request message is still being written: first the server's status (RESOURCE_EXHAUSTED for an oversized PutBlob,
say), then, when the write in flight fails, INTERNAL "Internal error from Core", which replaces it. Awaiting the
call then raised INTERNAL about 1 time in 1,200 under load, where the synchronous client always reports the
server's status. `first_status` keeps each status the call was given, and `awaited` raises the server's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

_BY_VALUE = {c.value[0]: c for c in grpc.StatusCode}
_CORE = "Internal error from Core"  # the details of grpc.aio's own INTERNAL for a failed write


def first_status(call: Any) -> Callable[[], Any | None]:
    """Watch `call` (a grpc.aio call); the returned function gives the first status it ended with other than
    grpc.aio's own INTERNAL for a failed write, or None."""
    kept: list[Any] = []

    def seen(c: Any) -> None:  # grpc.aio calls it at each status it sets, the status just set
        status = getattr(getattr(c, "_cython_call", None), "_status", None)
        if status is not None and not kept and status.details() != _CORE:
            kept.append(status)

    if hasattr(call, "add_done_callback"):  # a grpc.aio call; anything else awaitable is awaited as it is
        call.add_done_callback(seen)
    return lambda: kept[0] if kept else None


def server_error(e: grpc.RpcError, first: Any | None) -> grpc.RpcError:
    """`e`, or the error of the server's status `first` when `e` is grpc.aio's own INTERNAL for a failed write
    that replaced it."""
    if first is None or e.code() != grpc.StatusCode.INTERNAL or e.details() != _CORE:
        return e
    code = _BY_VALUE.get(int(first.code()))
    if code is None or code == grpc.StatusCode.OK:
        return e
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*(first.trailing_metadata() or ())),
                                first.details(), first.debug_error_string())


async def awaited(call: Any) -> Any:
    """The response of a client-streaming grpc.aio call; its failure as the server's status (server_error)."""
    first = first_status(call)
    try:
        return await call
    except grpc.RpcError as e:
        raise server_error(e, first()) from None
