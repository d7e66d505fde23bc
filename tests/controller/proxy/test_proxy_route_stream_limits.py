"""The proxy's RouteStreams are bounded in time and number (controller/proxy/route_stream.py): a stream unused for
idle_s is closed, and at max_streams a new token takes the place of the least recently used stream with no call
waiting on it; only when every stream has calls waiting do a new token's calls go unary.

NOTE: before, a stream lived as long as the proxy: after 70 tokens had each sent one request, 64 streams (with
~385 tasks) were still open 5 s later and the 71st token never got a stream (unary for good).

A grpc.aio controller of the test's own answers the routes, and counts the streams open at its end.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from controller.proxy.route_stream import RouteStreams
from fleet.api.kvfleet.v1 import route_pb2 as pb
from fleet.api.kvfleet.v1 import route_pb2_grpc as pbg


class _Controller(pbg.RouteServiceServicer):
    """Answers each route with the caller's token as the worker; a route of token "slow" is held until `go`."""

    def __init__(self) -> None:
        self.open: set[str] = set()  # tokens with a stream open here
        self.go = asyncio.Event()

    async def RouteStream(self, requests: AsyncIterator[pb.RouteStreamRequest],
                          context: Any) -> AsyncIterator[pb.RouteStreamResponse]:
        token = dict(context.invocation_metadata())["authorization"].removeprefix("Bearer ")
        self.open.add(token)
        try:
            async for msg in requests:
                if token == "slow":
                    await self.go.wait()
                yield pb.RouteStreamResponse(id=msg.id, route=pb.RouteResponse(worker=token, route_id=str(msg.id)))
        finally:
            self.open.discard(token)


async def _linked(**kw: Any) -> tuple[_Controller, grpc.aio.Server, grpc.aio.Channel, RouteStreams]:
    servicer = _Controller()
    server = grpc.aio.server()
    pbg.add_RouteServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    return servicer, server, channel, RouteStreams(pbg.RouteServiceStub(channel), "test", **kw)


async def _route(streams: RouteStreams, token: str) -> str:
    r = await streams.ask(token, 5.0, route=pb.RouteRequest(token_ids=[1, 2], model="m"))
    return str(r.worker)


async def _until(pred: Callable[[], bool]) -> None:
    for _ in range(200):
        if pred():
            return
        await asyncio.sleep(0.025)
    raise AssertionError("not within 5 s")


async def test_at_the_cap_a_new_token_takes_the_least_recently_used_stream() -> None:
    servicer, server, channel, streams = await _linked(max_streams=2)
    try:
        for token in ("a", "b", "a", "c"):  # b is then the least recently used: a was used again after it
            assert streams.usable(token)
            assert await _route(streams, token) == token
        assert list(streams._streams) == ["a", "c"]
        await _until(lambda: servicer.open == {"a", "c"})  # b's stream is closed at the controller too
        assert streams.usable("b") and await _route(streams, "b") == "b"  # and b can come back (a's place)
        assert list(streams._streams) == ["c", "b"]
    finally:
        await streams.close()
        await channel.close()
        await server.stop(0)


async def test_a_stream_with_a_call_waiting_keeps_its_place() -> None:
    servicer, server, channel, streams = await _linked(max_streams=1)
    try:
        held = asyncio.ensure_future(_route(streams, "slow"))
        await _until(lambda: "slow" in servicer.open)
        assert not streams.usable("x")  # the only stream has a call waiting: x goes unary (the control: below)
        servicer.go.set()
        assert await held == "slow"
        assert streams.usable("x") and await _route(streams, "x") == "x"
        assert list(streams._streams) == ["x"]
    finally:
        await streams.close()
        await channel.close()
        await server.stop(0)


async def test_an_idle_stream_is_closed_and_the_next_call_opens_another() -> None:
    servicer, server, channel, streams = await _linked(idle_s=0.2)
    try:
        assert await _route(streams, "a") == "a" and servicer.open == {"a"}
        first = streams._streams["a"]
        await _until(lambda: not streams._streams and not servicer.open)  # closed here and at the controller
        assert streams._sweep is None  # nothing left armed once no stream is open
        assert await _route(streams, "a") == "a" and streams._streams["a"] is not first
    finally:
        await streams.close()
        await channel.close()
        await server.stop(0)
