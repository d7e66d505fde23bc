"""One bearer token's RouteStream: messages matched to their answers by id, with releases carried on them.

- One writer task per stream sends the messages: a caller cancelled mid-write (its client went away) would
  otherwise cancel the whole call under every other caller (grpc.aio cancels the RPC when a write is cancelled).
- A stream that breaks (the controller restarted, the connection dropped) fails the calls waiting on it with
  the stream's status, and the next call opens a new one; nothing is retried here (the proxy answers 503).
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
from collections.abc import Callable
from typing import Any

import grpc

from controller.stream_batch import Batch, route_bytes
from fleet.api.kvfleet.v1 import route_pb2
from fleet.api.kvfleet.v1.route_pb2_grpc import RouteServiceStub
from fleet.core.errors import Unavailable
from fleet.sdk import base

log = logging.getLogger("kvfleet.proxy")
BATCH_S = 0.002  # the longest a release waits for a message to ride on
CARRIED = ("kvfleet-route-stream", "carried-releases")  # the controller's initial metadata: it takes carried releases
BATCHED = ("kvfleet-route-stream", "batched")  # the controller's initial metadata, and the proxy's call metadata
MAX_CARRIED = 1024  # releases carried on one message (the rest on the next); the controller takes up to 4x that
Done = Callable[[str], None]  # a carried release's outcome: "released", "unknown" or "failed"


class TokenStream:
    """One token's RouteStream: `send` a message and await its answer; `carry` a release on the next one."""

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
