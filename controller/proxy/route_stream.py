"""Route, ReleaseRoute and MoveRoute as messages of one RouteStream per token (the controller's RouteStream RPC).

A unary call pays a new HTTP/2 stream, its metadata and a task on both sides; the proxy makes two per request
(Route on the request path, ReleaseRoute after it), so it keeps one long-lived stream per bearer token and sends
each call as a message, matched to its answer by id. Measured in bench/proxy_load.py (docs/proxy.md).

- A controller without RouteStream (UNIMPLEMENTED: an older release) is remembered, and every call goes unary.
- At most `max_streams` tokens hold a stream. A new token takes the place of the least recently used stream with no
  call waiting on it (closed); only when every stream has calls waiting do its calls go unary.
- A stream unused for `idle_s` (60 s) is closed within a quarter more (its tasks here and its handler in the
  controller go); the token's next call opens another. NOTE: before, a stream lived as long as the proxy: after 64
  tokens had sent one request each, 64 streams (and ~385 tasks) stayed open for good and every new token's calls
  went unary.

Each stream's own mechanics (its writer, its breaking, carried releases, batches) are in token_stream.py.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import grpc

from controller.proxy.token_stream import Done, TokenStream
from fleet.api.kvfleet.v1 import route_pb2
from fleet.api.kvfleet.v1.route_pb2_grpc import RouteServiceStub
from fleet.core.errors import Unavailable
from fleet.sdk import base

log = logging.getLogger("kvfleet.proxy")
_ANSWER = {"route": "Route", "release": "ReleaseRoute", "move": "MoveRoute"}
MAX_STREAMS = 64
IDLE_S = 60.0  # a stream unused this long is closed
SWEEPS = 4  # looks per idle_s: an idle stream is closed within 1.25 x idle_s


def _orphaned(kind: str, orphan: Callable[[Any], None], fut: asyncio.Future[Any]) -> None:
    """An answer whose caller left: its op's part goes to `orphan` (nothing when the stream broke, or it failed)."""
    if not fut.cancelled() and fut.exception() is None and (msg := fut.result()).WhichOneof("result") == kind:
        orphan(getattr(msg, kind))


class StreamUnsupported(Exception):
    """The controller has no RouteStream: call unary."""


class RouteStreams:
    """The proxy's RouteStream per token; `ask` is one Route, ReleaseRoute or MoveRoute over it."""

    def __init__(self, stub: RouteServiceStub, target: str, max_streams: int = MAX_STREAMS,
                 idle_s: float = IDLE_S) -> None:
        assert max_streams >= 1 and idle_s > 0, (max_streams, idle_s)
        self.stub, self.target, self.max_streams, self.idle_s = stub, target, max_streams, idle_s
        self.supported = True
        self._streams: OrderedDict[str | None, TokenStream] = OrderedDict()  # least recently used first
        self._closing: set[asyncio.Task[None]] = set()  # streams being closed (held until done)
        self._sweep: asyncio.TimerHandle | None = None  # armed while a stream is open

    async def ask(self, token: str | None, timeout_s: float, orphan: Callable[[Any], None] | None = None,
                  **op: Any) -> Any:
        """The answer to one op (route=, release= or move=); raises StreamUnsupported (call unary instead) or
        the fleet.core.errors class of the status the unary call would have failed with. `orphan`: given the op's
        answer when it comes after its caller left (cancelled, or timed out), e.g. to release a route nobody uses.
        NOTE: the answer was dropped then, and a route the controller made for a client gone meanwhile was never
        released by the proxy: it counted as the worker's load until the controller's reconcile dropped it (review
        finding)."""
        kind = next(iter(op))
        method = _ANSWER[kind]
        stream = self._stream(token)
        ident, fut = stream.send(**op)
        try:
            async with asyncio.timeout(timeout_s):
                msg = await (fut if orphan is None else asyncio.shield(fut))  # (a cancel would cancel `fut` too)
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
            if orphan is not None and not fut.done():   # its caller left: its answer, when it comes, is the orphan's
                fut.add_done_callback(functools.partial(_orphaned, kind, orphan))
            else:
                stream.waiting.pop(ident, None)  # answered, timed out, or its caller cancelled
        if msg.WhichOneof("result") == "error":
            raise base.error_of(msg.error.code, msg.error.message, method, self.target)
        return getattr(msg, kind)

    def carry_release(self, token: str | None, route_id: str, done: Done) -> bool:
        """Release a route on the token's open stream, carried on its next message (`done` gets the outcome);
        False where it cannot be (no stream open for the token, or a controller that does not take them)."""
        s = self._streams.get(token)
        if s is None or s.broken is not None or not s.carries:
            return False
        self._streams.move_to_end(token)
        s.carry(route_pb2.ReleaseRouteRequest(route_id=route_id), done)
        return True

    async def drain(self, timeout_s: float) -> None:
        """Send the queued releases now and wait (at most timeout_s) for their outcomes."""
        for s in self._streams.values():
            s.flush()
        async with asyncio.timeout(timeout_s):
            while any(s.releases or s.carried for s in self._streams.values()):
                await asyncio.sleep(0.005)

    def usable(self, token: str | None) -> bool:
        return self.supported and (token in self._streams or len(self._streams) < self.max_streams
                                   or self._evictable() is not None)

    def _evictable(self) -> str | None:
        """The least recently used token whose stream has no call waiting (None: every stream has)."""
        return next((t for t, s in self._streams.items() if not s.busy), None)

    def _stream(self, token: str | None) -> TokenStream:
        s = self._streams.get(token)
        if s is not None and s.broken is None:
            self._streams.move_to_end(token)
            return s
        if s is not None:
            self._drop(token)
        elif len(self._streams) >= self.max_streams and (oldest := self._evictable()) is not None:
            self._drop(oldest)  # its place goes to this token (`usable` said there is one)
        s = self._streams[token] = TokenStream(self.stub, token, self.target)
        if self._sweep is None:
            self._sweep = asyncio.get_running_loop().call_later(self.idle_s / SWEEPS, self._close_idle)
        return s

    def _drop(self, token: str | None) -> None:
        """Close `token`'s stream in the background (held until done)."""
        task = asyncio.get_running_loop().create_task(self._streams.pop(token).close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def _close_idle(self) -> None:
        """Close the streams unused for idle_s with no call waiting; look again soon while any is open."""
        cutoff = time.monotonic() - self.idle_s
        for token in [t for t, s in self._streams.items() if s.used_at <= cutoff and not s.busy]:
            self._drop(token)
        self._sweep = (asyncio.get_running_loop().call_later(self.idle_s / SWEEPS, self._close_idle)
                       if self._streams else None)

    async def close(self) -> None:
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        streams, self._streams = list(self._streams.values()), OrderedDict()
        await asyncio.gather(*(s.close() for s in streams), *self._closing, return_exceptions=True)
