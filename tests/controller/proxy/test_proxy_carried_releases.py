"""The proxy's releases ride on its next RouteStream message (a Route, usually), or go together in one of their own
within token_stream.BATCH_S: at load a request costs the stream one message, not two (controller/proxy/token_stream.py,
controller/servicers/route.py, docs/proxy.md). Real controller, sims and proxy on loopback (support.proxy_fleet); the
controller from before carried releases is a real grpc.aio server with a RouteService servicer of its own.

NOTE: before, every release was a message of its own: N requests cost the stream exactly 2N messages from the proxy.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
from support.proxy_fleet import MODEL, start_fleet, until

from controller.cost import CostConfig
from controller.proxy.control import ControlClient
from controller.proxy.token_stream import BATCH_S
from controller.servicers.route import CARRIED
from fleet.api.kvfleet.v1 import route_pb2 as pb
from fleet.api.kvfleet.v1 import route_pb2_grpc as pbg

NO_RECONCILE = CostConfig(reconcile_grace_s=30.0)  # only a release may end a route


async def _flights(router: Any) -> int:
    return len(router.flights)


async def _value(counter: Any) -> float:
    return float(counter._value.get())


async def test_requests_at_load_cost_fewer_messages_and_every_route_is_released(tmp_path: Path) -> None:
    fleet = await start_fleet(tmp_path, cost=NO_RECONCILE)
    try:
        received = fleet.ctl.ctx.metrics.route_stream_messages.labels("received")
        router = fleet.ctl.ctx.need_router()

        async def client(c: int) -> None:
            for turn in range(3):
                status, _, body = await fleet.post("/v1/completions", {"model": MODEL, "prompt": f"c{c} t{turn}",
                                                                       "max_tokens": 2})
                assert status == 200, body

        before = received._value.get()
        await asyncio.gather(*(client(c) for c in range(20)))
        await until(lambda: _flights(router), lambda n: n == 0)  # every route released, none by reconcile
        n, messages = 60, received._value.get() - before
        print(f"{n} requests at 20 clients: {messages:.0f} RouteStream messages from the proxy (before: {2 * n})")
        assert messages < 2 * n
        said = fleet.proxy.metrics.releases.labels("released")
        await until(lambda: _value(said), lambda k: k == n)  # each outcome reached the proxy (its answer's `released`)
        assert router.metrics.route_releases.labels("released")._value.get() == n
    finally:
        await fleet.stop()


async def test_a_release_on_a_quiet_stream_leaves_at_once_in_a_message_of_its_own(tmp_path: Path) -> None:
    fleet = await start_fleet(tmp_path, cost=NO_RECONCILE)
    control = ControlClient(fleet.proxy.control.target)
    try:
        received = fleet.ctl.ctx.metrics.route_stream_messages.labels("received")
        router, token = fleet.ctl.ctx.need_router(), fleet.tokens["a"]
        d = await control.route([1, 2, 3, 4], MODEL, lora=None, token=token)
        assert await _flights(router) == 1 and received._value.get() == 1
        outcome: asyncio.Future[tuple[str, float]] = asyncio.get_running_loop().create_future()
        t0 = time.perf_counter()
        control.release_soon(d.route_id, token, lambda o: outcome.set_result((o, time.perf_counter() - t0)))
        stream = control._streams._streams[token]  # type: ignore[union-attr]
        assert stream._flush is None and stream.outbox.qsize() == 1  # no call waiting: sent now, not in BATCH_S
        said, took = await asyncio.wait_for(outcome, 5.0)
        print(f"a release on a quiet stream answered {took * 1e3:.1f} ms after it was queued (no call waiting: "
              "nothing to wait for)")
        assert said == "released" and await _flights(router) == 0
        assert received._value.get() == 2  # the route, then the release in a message of its own
        assert stream.carries and not stream.busy
    finally:
        await control.close()
        await fleet.stop()


async def test_releases_carried_on_a_refused_route_are_still_released(tmp_path: Path) -> None:
    fleet = await start_fleet(tmp_path, cost=NO_RECONCILE)
    control = ControlClient(fleet.proxy.control.target)
    try:
        router, token = fleet.ctl.ctx.need_router(), fleet.tokens["a"]
        d = await control.route([5, 6, 7], MODEL, lora=None, token=token)
        call = control._route.RouteStream(metadata=(("authorization", f"Bearer {token}"),))
        try:
            assert CARRIED in tuple(await call.initial_metadata())  # the controller says it takes them
            bad = pb.RouteStreamRequest(id=1, route=pb.RouteRequest(token_ids=[1], model=""))  # no model: refused
            bad.releases.add(route_id=d.route_id)
            bad.releases.add(route_id="0" * 32)  # no such route
            bad.releases.add(route_id="not-a-route-id")  # refused alone, never failing the others
            await call.write(bad)
            out = await call.read()
            assert (out.id, out.WhichOneof("result"), out.error.code) == (1, "error", "INVALID_ARGUMENT")
            assert list(out.released) == [True, False, False] and await _flights(router) == 0
            alone = pb.RouteStreamRequest(id=2)
            alone.releases.add(route_id=d.route_id)  # already released: as the unary answer says
            await call.write(alone)
            out = await call.read()
            assert (out.id, out.WhichOneof("result"), list(out.released)) == (2, None, [False])
        finally:
            call.cancel()
    finally:
        await control.close()
        await fleet.stop()


class _Holds(pbg.RouteServiceServicer):
    """Takes carried releases (says so, as the controller does) and records every message; holds a route whose first
    token is 0 unanswered until `go` is set (a call waiting on the stream: the proxy at load)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str | None, list[str], bool]] = []  # op, carried route ids, a held route unanswered
        self.go = asyncio.Event()
        self.held = 0

    async def RouteStream(self, requests: AsyncIterator[pb.RouteStreamRequest],
                          context: Any) -> AsyncIterator[pb.RouteStreamResponse]:
        await context.send_initial_metadata((CARRIED,))
        answers: asyncio.Queue[pb.RouteStreamResponse] = asyncio.Queue()

        async def answer(msg: pb.RouteStreamRequest) -> None:
            op = msg.WhichOneof("op")
            self.seen.append((op, [r.route_id for r in msg.releases], self.held > 0))
            if op == "route" and msg.route.token_ids[0] == 0:
                self.held += 1
                await self.go.wait()
                self.held -= 1
            out = pb.RouteStreamResponse(id=msg.id, released=[True] * len(msg.releases))
            if op == "route":
                out.route.CopyFrom(pb.RouteResponse(worker="w0", route_id=f"r{msg.id}"))
            answers.put_nowait(out)

        async def read() -> None:
            async for msg in requests:
                asyncio.get_running_loop().create_task(answer(msg))

        reader = asyncio.get_running_loop().create_task(read())
        try:
            while True:
                yield await answers.get()
        finally:
            reader.cancel()


@contextlib.asynccontextmanager
async def _serving(servicer: Any) -> AsyncIterator[tuple[Any, ControlClient]]:
    """A RouteService on loopback serving `servicer`, and the proxy's ControlClient to it (closed, then the server)."""
    server = grpc.aio.server()
    pbg.add_RouteServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    control = ControlClient(f"127.0.0.1:{port}")
    try:
        yield servicer, control
    finally:
        await control.close()
        await server.stop(0)


async def test_a_release_while_calls_wait_rides_on_the_next_route_or_leaves_alone_within_the_bound() -> None:
    async with _serving(_Holds()) as (servicer, control):
        first = await control.route([1], MODEL, lora=None, token="t")
        second = await control.route([2], MODEL, lora=None, token="t")
        held = asyncio.create_task(control.route([0], MODEL, lora=None, token="t"))
        await until(lambda: _held(servicer), bool)  # a call waits on the stream
        outcomes: list[str] = []
        control.release_soon(first.route_id, "t", outcomes.append)
        await control.route([3], MODEL, lora=None, token="t")  # sent before BATCH_S ran out: it carries the release
        assert servicer.seen[-1] == ("route", [first.route_id], True) and outcomes == ["released"]
        said: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        t0 = time.perf_counter()
        control.release_soon(second.route_id, "t", lambda o: (outcomes.append(o), said.set_result(time.perf_counter())))
        took = await asyncio.wait_for(said, 5.0) - t0  # nothing else to carry it: a message of its own
        print(f"a release with nothing to ride on answered {took * 1e3:.1f} ms after it was queued")
        assert servicer.seen[-1] == (None, [second.route_id], True) and outcomes == ["released", "released"]
        assert took >= BATCH_S  # it waited for a message to ride on (before: sent at once, a message of its own)
        servicer.go.set()
        assert (await held).route_id


async def test_the_proxys_close_sends_the_queued_releases_and_waits_for_them() -> None:
    async with _serving(_Holds()) as (servicer, control):
        first = await control.route([1], MODEL, lora=None, token="t")
        held = asyncio.create_task(control.route([0], MODEL, lora=None, token="t"))
        await until(lambda: _held(servicer), bool)
        outcomes: list[str] = []
        control.release_soon(first.route_id, "t", outcomes.append)  # queued for BATCH_S: a call waits
        await control.close()  # at once: without the drain the stream's close failed it ("failed", never sent)
        assert outcomes == ["released"] and servicer.seen[-1] == (None, [first.route_id], True)
        servicer.go.set()
        await asyncio.gather(held, return_exceptions=True)  # cut by the close


async def _held(servicer: _Holds) -> int:
    return servicer.held


class _Before(pbg.RouteServiceServicer):
    """A controller from before carried releases: it answers route and release messages and ignores the field."""

    def __init__(self) -> None:
        self.ops: list[str | None] = []

    async def RouteStream(self, requests: AsyncIterator[pb.RouteStreamRequest],
                          context: Any) -> AsyncIterator[pb.RouteStreamResponse]:
        async for msg in requests:
            self.ops.append(msg.WhichOneof("op"))
            if msg.WhichOneof("op") == "route":
                yield pb.RouteStreamResponse(id=msg.id, route=pb.RouteResponse(worker="w0", route_id="r1"))
            else:
                yield pb.RouteStreamResponse(id=msg.id, release=pb.ReleaseRouteResponse(released=True))


async def test_a_controller_from_before_gets_each_release_as_its_own_message() -> None:
    async with _serving(_Before()) as (servicer, control):
        d = await control.route([1, 2], MODEL, lora=None, token="t")
        outcome: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        control.release_soon(d.route_id, "t", outcome.set_result)
        assert await asyncio.wait_for(outcome, 5.0) == "released"
        assert servicer.ops == ["route", "release"]  # not carried: that controller would have dropped it
