"""Route, ReleaseRoute and MoveRoute as messages of one RouteStream per token (the controller's RouteStream RPC).

A unary call pays a new HTTP/2 stream, its metadata and a task on both sides; the proxy makes two per request
(Route on the request path, ReleaseRoute after it), so it keeps one long-lived stream per bearer token and sends
each call as a message, matched to its answer by id. Measured in bench/proxy_load.py (docs/proxy.md).

- One writer task per stream sends the messages: a caller cancelled mid-write (its client went away) would
  otherwise cancel the whole call under every other caller (grpc.aio cancels the RPC when a write is cancelled).
- A stream that breaks (the controller restarted, the connection dropped) fails the calls waiting on it with
  the stream's status, and the next call opens a new one; nothing is retried here (the proxy answers 503).
- A controller without RouteStream (UNIMPLEMENTED: an older release) is remembered, and every call goes unary.
- At most `max_streams` tokens hold a stream; the calls of any other token go unary.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Any

import grpc

from fleet.api.kvfleet.v1 import route_pb2
from fleet.api.kvfleet.v1.route_pb2_grpc import RouteServiceStub
from fleet.core.errors import Unavailable
from fleet.sdk import base

log = logging.getLogger("kvfleet.proxy")
_ANSWER = {"route": "Route", "release": "ReleaseRoute", "move": "MoveRoute"}


class StreamUnsupported(Exception):
    """The controller has no RouteStream: call unary."""


class _Stream:
    def __init__(self, stub: RouteServiceStub, token: str | None, target: str) -> None:
        self.target = target
        self.call = stub.RouteStream(metadata=base.metadata(token))
        self.waiting: dict[int, asyncio.Future[route_pb2.RouteStreamResponse]] = {}
        self.outbox: asyncio.Queue[route_pb2.RouteStreamRequest] = asyncio.Queue()
        self.ids = itertools.count(1)
        self.broken: BaseException | None = None
        loop = asyncio.get_running_loop()
        self.tasks = (loop.create_task(self._write()), loop.create_task(self._read()))

    def send(self, **op: Any) -> tuple[int, asyncio.Future[route_pb2.RouteStreamResponse]]:
        """Queue one message; its id (for `waiting`) and the future its answer completes."""
        ident = next(self.ids)
        fut: asyncio.Future[route_pb2.RouteStreamResponse] = asyncio.get_running_loop().create_future()
        self.waiting[ident] = fut
        self.outbox.put_nowait(route_pb2.RouteStreamRequest(id=ident, **op))
        return ident, fut

    async def _write(self) -> None:
        try:
            while True:
                await self.call.write(await self.outbox.get())
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001  # the call failed: the reader sees its status
            self._break(e)

    async def _read(self) -> None:
        try:
            while True:
                msg = await self.call.read()
                if msg is grpc.aio.EOF:
                    raise Unavailable(f"RouteStream at {self.target}: the controller ended the stream")
                fut = self.waiting.pop(msg.id, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
        except asyncio.CancelledError:
            self._break(Unavailable(f"RouteStream at {self.target}: closed"))
            raise
        except BaseException as e:  # noqa: BLE001
            self._break(e)

    def _break(self, e: BaseException) -> None:
        if self.broken is None:
            self.broken = e
        waiting, self.waiting = self.waiting, {}
        for fut in waiting.values():
            if not fut.done():
                fut.set_exception(self.broken)
        self.call.cancel()

    async def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.call.cancel()


class RouteStreams:
    """The proxy's RouteStream per token; `ask` is one Route, ReleaseRoute or MoveRoute over it."""

    def __init__(self, stub: RouteServiceStub, target: str, max_streams: int = 64) -> None:
        self.stub, self.target, self.max_streams = stub, target, max_streams
        self.supported = True
        self._streams: dict[str | None, _Stream] = {}
        self._closing: set[asyncio.Task[None]] = set()  # broken streams being closed (held until done)

    async def ask(self, token: str | None, timeout_s: float, **op: Any) -> Any:
        """The answer to one op (route=, release= or move=); raises StreamUnsupported (call unary instead) or
        the fleet.core.errors class of the status the unary call would have failed with."""
        kind = next(iter(op))
        method = _ANSWER[kind]
        stream = self._stream(token)
        ident, fut = stream.send(**op)
        try:
            async with asyncio.timeout(timeout_s):
                msg = await fut
        except TimeoutError:
            raise Unavailable(f"{method} at {self.target}: deadline exceeded (no answer on the RouteStream within "
                              f"{timeout_s}s); the controller is slow or unreachable, raise the client's timeout "
                              "or check the controller") from None
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                self.supported = False
                log.info("proxy: the controller at %s has no RouteStream; routing with unary calls", self.target)
                raise StreamUnsupported() from None
            raise base.to_error(e, method, self.target) from e
        finally:
            stream.waiting.pop(ident, None)  # answered, timed out, or its caller cancelled
        if msg.WhichOneof("result") == "error":
            raise base.error_of(msg.error.code, msg.error.message, method, self.target)
        return getattr(msg, kind)

    def usable(self, token: str | None) -> bool:
        return self.supported and (token in self._streams or len(self._streams) < self.max_streams)

    def _stream(self, token: str | None) -> _Stream:
        s = self._streams.get(token)
        if s is None or s.broken is not None:
            if s is not None:
                task = asyncio.get_running_loop().create_task(s.close())
                self._closing.add(task)
                task.add_done_callback(self._closing.discard)
            s = self._streams[token] = _Stream(self.stub, token, self.target)
        return s

    async def close(self) -> None:
        streams, self._streams = list(self._streams.values()), {}
        await asyncio.gather(*(s.close() for s in streams), *self._closing, return_exceptions=True)
