"""Route, ReleaseRoute and MoveRoute as messages of one RouteStream per token (the controller's RouteStream RPC).

A unary call pays a new HTTP/2 stream, its metadata and a task on both sides; the proxy makes two per request
(Route on the request path, ReleaseRoute after it), so it keeps one long-lived stream per bearer token and sends
each call as a message, matched to its answer by id. Measured in bench/proxy_load.py (docs/proxy.md).

- One writer task per stream sends the messages: a caller cancelled mid-write (its client went away) would
  otherwise cancel the whole call under every other caller (grpc.aio cancels the RPC when a write is cancelled).
- A stream that breaks (the controller restarted, the connection dropped) fails the calls waiting on it with
  the stream's status, and the next call opens a new one; nothing is retried here (the proxy answers 503).
- A controller without RouteStream (UNIMPLEMENTED: an older release) is remembered, and every call goes unary.
- At most `max_streams` tokens hold a stream. A new token takes the place of the least recently used stream with no
  call waiting on it (closed); only when every stream has calls waiting do its calls go unary.
- A stream unused for `idle_s` (60 s) is closed within a quarter more (its tasks here and its handler in the
  controller go); the token's next call opens another. NOTE: before, a stream lived as long as the proxy: after 64
  tokens had sent one request each, 64 streams (and ~385 tasks) stayed open for good and every new token's calls
  went unary.
- A release is not a message of its own where the controller takes carried releases (it says so when the stream
  opens): while calls are waiting on the stream it waits, at most `batch_s` (2 ms), for the next message to ride
  on (a Route, usually), and then goes in a message of its own with every other release queued by then; on a quiet
  stream it goes at once. Its outcome comes back in that message's answer.
  At 200 clients that halves the stream's messages (docs/proxy.md); a route counts as in flight on its worker
  for at most `batch_s` longer. A controller from before gets each release as its own message.
- Messages that queue while a write is in flight go in the next write together (`more`), and the controller
  answers several in one, where it says it takes them (BATCHED): under load a write of a stream, and its read on
  the other side, cost about as much CPU as the routing it carries (docs/proxy.md, "RouteStream batches"). Nothing
  waits for a batch to fill: a quiet stream sends each message alone, as before. A write's messages together stay
  within stream_batch.MAX_BATCH_BYTES (a message alone goes whatever its size), well under the controller's receive
  limit; controller/stream_batch.py holds the one rule both sides batch by.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import grpc

from controller.stream_batch import Batch, route_bytes
from fleet.api.kvfleet.v1 import route_pb2
from fleet.api.kvfleet.v1.route_pb2_grpc import RouteServiceStub
from fleet.core.errors import Unavailable
from fleet.sdk import base

log = logging.getLogger("kvfleet.proxy")
_ANSWER = {"route": "Route", "release": "ReleaseRoute", "move": "MoveRoute"}
MAX_STREAMS = 64
IDLE_S = 60.0  # a stream unused this long is closed
SWEEPS = 4  # looks per idle_s: an idle stream is closed within 1.25 x idle_s
BATCH_S = 0.002  # the longest a release waits for a message to ride on
CARRIED = ("kvfleet-route-stream", "carried-releases")  # the controller's initial metadata: it takes carried releases
BATCHED = ("kvfleet-route-stream", "batched")  # the controller's initial metadata, and the proxy's call metadata
MAX_CARRIED = 1024  # releases carried on one message (the rest on the next); the controller takes up to 4x that
Done = Callable[[str], None]  # a carried release's outcome: "released", "unknown" or "failed"


class StreamUnsupported(Exception):
    """The controller has no RouteStream: call unary."""


class _Stream:
    def __init__(self, stub: RouteServiceStub, token: str | None, target: str, batch_s: float = BATCH_S) -> None:
        self.target, self.batch_s = target, batch_s
        self.call = stub.RouteStream(metadata=(*base.metadata(token), BATCHED))
        self.waiting: dict[int, asyncio.Future[route_pb2.RouteStreamResponse]] = {}
        self.outbox: asyncio.Queue[route_pb2.RouteStreamRequest | None] = asyncio.Queue()  # None: send the releases
        self.carries = False  # the controller said it takes carried releases
        self.batches = False  # the controller said it takes several messages in one
        self.releases: list[tuple[route_pb2.ReleaseRouteRequest, Done]] = []  # queued, not yet sent
        self.carried: dict[int, list[Done]] = {}  # releases sent on message id, waiting for its answer
        self._flush: asyncio.TimerHandle | None = None  # armed while releases are queued
        self.ids = itertools.count(1)
        self.broken: BaseException | None = None
        self.used_at = time.monotonic()  # the last message sent
        loop = asyncio.get_running_loop()
        self.tasks = (loop.create_task(self._write()), loop.create_task(self._read()))

    def send(self, **op: Any) -> tuple[int, asyncio.Future[route_pb2.RouteStreamResponse]]:
        """Queue one message; its id (for `waiting`) and the future its answer completes."""
        ident = next(self.ids)
        self.used_at = time.monotonic()
        fut: asyncio.Future[route_pb2.RouteStreamResponse] = asyncio.get_running_loop().create_future()
        self.waiting[ident] = fut
        self.outbox.put_nowait(route_pb2.RouteStreamRequest(id=ident, **op))
        return ident, fut

    @property
    def busy(self) -> bool:
        """A call or a release is waiting on the stream (it is not closed for idleness or another token)."""
        return bool(self.waiting or self.releases or self.carried)

    def carry(self, req: route_pb2.ReleaseRouteRequest, done: Done) -> None:
        """Queue a release for the next message, or for one of its own within batch_s; at once where no call is
        waiting (the stream is quiet, so no Route is due to carry it)."""
        self.used_at = time.monotonic()
        self.releases.append((req, done))
        if not self.waiting:
            # NOTE: held back on a quiet stream, it went out 2 ms later, just as the client's next request came
            # through: its send and its answer then ran on that request's path
            self.flush()
        elif self._flush is None:
            self._flush = asyncio.get_running_loop().call_later(self.batch_s, self.flush)

    def flush(self) -> None:
        """Send the queued releases now (with the next message the writer takes, or alone)."""
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        if self.releases:
            self.outbox.put_nowait(None)

    def _load(self, msg: route_pb2.RouteStreamRequest | None) -> route_pb2.RouteStreamRequest | None:
        """`msg` carrying the queued releases, MAX_CARRIED at most (a message of their own where msg is None; the
        rest go on the next message, sent at once); None: nothing to send."""
        if not self.releases:
            return msg
        if msg is None:
            msg = route_pb2.RouteStreamRequest(id=next(self.ids))
        took, self.releases = self.releases[:MAX_CARRIED], self.releases[MAX_CARRIED:]
        msg.releases.extend(req for req, _ in took)
        self.carried[msg.id] = [done for _, done in took]
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        if self.releases:
            self.outbox.put_nowait(None)
        return msg

    def _settle(self, msg: route_pb2.RouteStreamResponse) -> None:
        """The outcomes of the releases `msg` answers (failed where the controller did not look at them)."""
        done = self.carried.pop(msg.id, [])
        if len(msg.released) < len(done) and msg.WhichOneof("result") == "error":
            log.info("proxy: %d ReleaseRoutes failed: %s: %s", len(done), msg.error.code, msg.error.message)
        for i, d in enumerate(done):
            _tell(d, ("released" if msg.released[i] else "unknown") if i < len(msg.released) else "failed")

    async def _write(self) -> None:
        held: route_pb2.RouteStreamRequest | None = None  # taken off the outbox, over the last write's bytes
        try:
            while True:
                msg, held = (held, None) if held is not None else (self._load(await self.outbox.get()), None)
                batch = None if msg is None else Batch(msg, route_bytes)
                while self.batches and not self.outbox.empty():
                    nxt = self._load(self.outbox.get_nowait())  # what queued while the last write was in flight
                    if nxt is None:
                        continue
                    if batch is None:
                        msg, batch = nxt, Batch(nxt, route_bytes)
                    elif batch.take(nxt):
                        batch.first.more.append(nxt)
                    else:
                        held = nxt  # the next write's first
                        break
                if msg is not None:
                    await self.call.write(msg)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001  # the call failed: the reader sees its status
            self._break(e)

    async def _read(self) -> None:
        try:
            said = tuple(await self.call.initial_metadata() or ())  # (key, value) pairs
            self.carries, self.batches = CARRIED in said, BATCHED in said
            while True:
                msg = await self.call.read()
                if msg is grpc.aio.EOF:
                    raise Unavailable(f"RouteStream at {self.target}: the controller ended the stream")
                for one in (msg, *msg.more):  # the answers sent in this one, each alone
                    fut = self.waiting.pop(one.id, None)
                    if fut is not None and not fut.done():
                        fut.set_result(one)
                    if self.carried:
                        self._settle(one)
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
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        lost = [d for _, d in self.releases] + [d for done in self.carried.values() for d in done]
        self.releases, self.carried = [], {}
        if lost:
            log.info("proxy: %d ReleaseRoutes failed: the RouteStream broke: %s", len(lost), self.broken)
        for d in lost:
            _tell(d, "failed")
        self.call.cancel()

    async def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.call.cancel()


def _tell(done: Done, outcome: str) -> None:
    try:
        done(outcome)
    except Exception:  # noqa: BLE001  # the caller's callback: never the stream's reader
        log.exception("proxy: a release's callback failed")


class RouteStreams:
    """The proxy's RouteStream per token; `ask` is one Route, ReleaseRoute or MoveRoute over it."""

    def __init__(self, stub: RouteServiceStub, target: str, max_streams: int = MAX_STREAMS,
                 idle_s: float = IDLE_S) -> None:
        assert max_streams >= 1 and idle_s > 0, (max_streams, idle_s)
        self.stub, self.target, self.max_streams, self.idle_s = stub, target, max_streams, idle_s
        self.supported = True
        self._streams: OrderedDict[str | None, _Stream] = OrderedDict()  # least recently used first
        self._closing: set[asyncio.Task[None]] = set()  # streams being closed (held until done)
        self._sweep: asyncio.TimerHandle | None = None  # armed while a stream is open

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

    def _stream(self, token: str | None) -> _Stream:
        s = self._streams.get(token)
        if s is not None and s.broken is None:
            self._streams.move_to_end(token)
            return s
        if s is not None:
            self._drop(token)
        elif len(self._streams) >= self.max_streams and (oldest := self._evictable()) is not None:
            self._drop(oldest)  # its place goes to this token (`usable` said there is one)
        s = self._streams[token] = _Stream(self.stub, token, self.target)
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
