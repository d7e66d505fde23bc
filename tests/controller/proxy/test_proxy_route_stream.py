"""The proxy's Route, ReleaseRoute and MoveRoute travel as messages of one RouteStream per token
(controller/proxy/route_stream.py, the controller's RouteStream in controller/servicers/route.py).

Real controller, sims and proxy on loopback (support.proxy_fleet); the two controllers without RouteStream or
with one that breaks are real grpc.aio servers with a RouteService servicer of their own."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from support.proxy_fleet import MODEL, Fleet, linked_fleet, proxy_released, start_fleet, until

from controller.auth import hash_token
from controller.proxy.control import ControlClient
from fleet.api.kvfleet.v1 import route_pb2 as pb
from fleet.api.kvfleet.v1 import route_pb2_grpc as pbg
from fleet.core.errors import InvalidArgument, Unauthenticated, Unavailable


def _count_unary(control: ControlClient) -> dict[str, int]:
    calls = {"Route": 0, "ReleaseRoute": 0, "MoveRoute": 0}
    for name in calls:
        real = getattr(control._route, name)

        def counted(*a: Any, _real: Any = real, _name: str = name, **k: Any) -> Any:
            calls[_name] += 1
            return _real(*a, **k)

        setattr(control._route, name, counted)
    return calls


async def test_the_proxy_routes_and_releases_over_one_stream(tmp_path: Path) -> None:
    fleet = await start_fleet(tmp_path)
    try:
        control = fleet.proxy.control
        unary = _count_unary(control)
        router = fleet.ctl.ctx.need_router()
        for i in range(4):
            status, headers, _ = await fleet.post("/v1/completions", {"model": MODEL, "prompt": f"hi {i}",
                                                                      "max_tokens": 4})
            assert status == 200 and headers["x-kvfleet-worker"]
        await until(lambda: _flights(router), lambda n: n == 0)  # every route released
        await proxy_released(fleet, 4)
        assert unary == {"Route": 0, "ReleaseRoute": 0, "MoveRoute": 0}
        streams = control._streams._streams
        assert list(streams) == [fleet.tokens["a"]] and streams[fleet.tokens["a"]].broken is None
    finally:
        await fleet.stop()


async def _flights(router: Any) -> int:
    return len(router.flights)


@pytest.fixture
async def linked(tmp_path: Path) -> AsyncIterator[tuple[Fleet, ControlClient]]:
    """A fleet and a ControlClient of the test's own to its controller (the proxy's kept apart)."""
    async with linked_fleet(tmp_path) as both:
        yield both


async def test_a_failed_message_is_its_answer_and_the_stream_goes_on(linked: tuple[Fleet, ControlClient]) -> None:
    fleet, control = linked
    token = fleet.tokens["a"]
    first = await control.route([1, 2, 3, 4], MODEL, lora=None, token=token)
    stream = control._streams._streams[token]  # type: ignore[union-attr]
    with pytest.raises(InvalidArgument, match="model name"):
        await control.route([1, 2, 3], "", lora=None, token=token)  # as the unary Route refuses it
    again = await control.route([1, 2, 3, 4, 5], MODEL, lora=None, token=token)
    assert first.route_id and again.route_id and first.route_id != again.route_id
    assert await control.release(first.route_id, token) == "released"
    assert await control.release(first.route_id, token) == "unknown"  # ended: as the unary answer says
    assert control._streams._streams[token] is stream and stream.broken is None  # type: ignore[union-attr]


async def test_a_caller_cancelled_mid_call_does_not_break_the_stream_under_the_others(
    linked: tuple[Fleet, ControlClient],
) -> None:
    fleet, control = linked
    token = fleet.tokens["a"]
    await control.route([9, 9, 9], MODEL, lora=None, token=token)  # the stream is open
    stream = control._streams._streams[token]  # type: ignore[union-attr]
    calls = [asyncio.create_task(control.route(list(range(i, i + 40)), MODEL, lora=None, token=token))
             for i in range(40)]
    await asyncio.sleep(0)
    for c in calls[::2]:
        c.cancel()  # their clients went away: some mid-write, some waiting for the answer
    done = await asyncio.gather(*calls, return_exceptions=True)
    kept = [d for d in done[1::2]]
    assert all(not isinstance(d, BaseException) and d.route_id for d in kept), kept
    assert all(isinstance(d, asyncio.CancelledError) for d in done[::2])
    assert control._streams._streams[token] is stream and stream.broken is None  # type: ignore[union-attr]
    assert not stream.waiting  # the cancelled callers' entries are gone too


async def test_a_revoked_token_fails_its_next_message(linked: tuple[Fleet, ControlClient], tmp_path: Path) -> None:
    fleet, control = linked
    token = fleet.tokens["a"]
    await control.route([1, 2, 3], MODEL, lora=None, token=token)  # the stream is open, authenticated
    doc = json.loads((tmp_path / "tokens.json").read_text())
    doc["tokens"] = [e for e in doc["tokens"] if e["sha256"] != hash_token(token)]
    (tmp_path / "tokens.json").write_text(json.dumps(doc))  # the controller reloads it when it changes

    async def refused() -> bool:
        try:
            await control.route([1, 2, 3], MODEL, lora=None, token=token)
        except Unauthenticated:
            return True
        return False

    await until(refused, bool, timeout=10.0)
    assert (await control.route([4, 5], MODEL, lora=None, token=fleet.tokens["b"])).route_id  # others go on


class _UnaryOnly(pbg.RouteServiceServicer):
    """A controller from before RouteStream: the base servicer answers it UNIMPLEMENTED."""

    def __init__(self) -> None:
        self.routes = 0

    async def Route(self, request: pb.RouteRequest, context: Any) -> pb.RouteResponse:
        self.routes += 1
        return pb.RouteResponse(worker="w0", url="http://127.0.0.1:1", route_id=f"r{self.routes}")


class _Breaks(pbg.RouteServiceServicer):
    """Answers each stream's first message; at its second, ends the stream UNAVAILABLE (a controller going away)."""

    def __init__(self) -> None:
        self.streams = 0

    async def RouteStream(self, requests: AsyncIterator[pb.RouteStreamRequest],
                          context: Any) -> AsyncIterator[pb.RouteStreamResponse]:
        self.streams += 1
        n = self.streams
        async for msg in requests:
            if msg.route.token_ids[0] == 2:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "going away")
            yield pb.RouteStreamResponse(id=msg.id, route=pb.RouteResponse(worker="w0", route_id=f"s{n}"))


async def _serve(servicer: pbg.RouteServiceServicer) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    pbg.add_RouteServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def test_a_controller_without_route_stream_is_routed_with_unary_calls() -> None:
    servicer = _UnaryOnly()
    server, target = await _serve(servicer)
    control = ControlClient(target)
    try:
        assert (await control.route([1, 2], MODEL, lora=None, token="t")).route_id == "r1"  # no error surfaced
        assert control._streams is not None and control._streams.supported is False
        assert (await control.route([1, 2], MODEL, lora=None, token="t")).route_id == "r2"
        assert servicer.routes == 2
    finally:
        await control.close()
        await server.stop(0)


async def test_a_broken_stream_fails_its_waiting_call_and_the_next_call_opens_another() -> None:
    servicer = _Breaks()
    server, target = await _serve(servicer)
    control = ControlClient(target)
    try:
        assert (await control.route([1], MODEL, lora=None, token="t")).route_id == "s1"
        stream = control._streams._streams["t"]  # type: ignore[union-attr]
        with pytest.raises(Unavailable, match="going away"):
            await control.route([2], MODEL, lora=None, token="t")  # waiting on the stream when it ends
        assert stream.broken is not None and not stream.waiting
        assert (await control.route([1], MODEL, lora=None, token="t")).route_id == "s2"  # a new stream
        assert servicer.streams == 2 and control._streams._streams["t"] is not stream  # type: ignore[union-attr]
    finally:
        await control.close()
        await server.stop(0)


async def test_a_message_without_an_op_is_refused_by_its_answer_and_the_stream_goes_on(
    linked: tuple[Fleet, ControlClient],
) -> None:
    fleet, control = linked
    call = control._route.RouteStream(metadata=(("authorization", f"Bearer {fleet.tokens['a']}"),))
    try:
        await call.write(pb.RouteStreamRequest(id=7))  # no route, release or move
        bad = await call.read()
        assert (bad.id, bad.WhichOneof("result"), bad.error.code) == (7, "error", "INVALID_ARGUMENT")
        assert "route, release or move" in bad.error.message
        await call.write(pb.RouteStreamRequest(id=8, route=pb.RouteRequest(token_ids=[1, 2, 3], model=MODEL)))
        good = await call.read()
        assert (good.id, good.WhichOneof("result")) == (8, "route") and good.route.worker
    finally:
        call.cancel()


async def test_an_undecodable_message_ends_the_stream_invalid_argument(linked: tuple[Fleet, ControlClient]) -> None:
    fleet, control = linked
    call = control._channel.stream_stream(
        "/kvfleet.v1.RouteService/RouteStream", request_serializer=None,
        response_deserializer=pb.RouteStreamResponse.FromString,
    )(metadata=(("authorization", f"Bearer {fleet.tokens['a']}"),))
    await call.write(b"\x08\xff")  # field 1, a varint cut short: not a RouteStreamRequest
    with pytest.raises(grpc.aio.AioRpcError) as e:
        async with asyncio.timeout(10):  # no answer at all would be a failure too, not a hang
            await call.read()
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "RouteStream" in (e.value.details() or "")


async def test_a_stream_whose_answers_are_not_read_stops_being_read(tmp_path: Path) -> None:
    # Before, a message's slot was freed once its answer was queued, not written: a caller that sent and never
    # read grew the controller's answer queue without bound (82,000 answers, +89 MiB in 30 s). Now at most
    # STREAM_IN_FLIGHT answers wait to be written; then the stream is not read (HTTP/2 holds the caller back).
    fleet = await start_fleet(tmp_path)
    try:
        errors = fleet.ctl.ctx.metrics.rpc_errors.labels(method="Route", code="INVALID_ARGUMENT")
        before = errors._value.get()
        # NOTE: no BDP probes, so the caller's HTTP/2 window stays at its initial 64 KiB instead of growing to
        # megabytes: a few thousand unread answers fill it
        async with grpc.aio.insecure_channel(fleet.proxy.control.target, options=[("grpc.http2.bdp_probe", 0)]) as ch:
            call = pbg.RouteServiceStub(ch).RouteStream(metadata=(("authorization", f"Bearer {fleet.tokens['a']}"),))
            n = 5000
            for i in range(n):  # refused messages (no model): each answered with an error, counted
                await call.write(pb.RouteStreamRequest(id=i, route=pb.RouteRequest(token_ids=[1, 2, 3])))
            await asyncio.sleep(1.0)
            answered_unread = errors._value.get() - before
            print(f"{n} messages sent, none read: the controller answered {answered_unread:.0f}")
            assert answered_unread < n / 2  # what the caller's 64 KiB window takes, and STREAM_IN_FLIGHT (old: n)
            got = 0
            async for _ in call:  # the control: read, every message is answered
                got += 1
                if got == n:
                    break
            assert got == n and errors._value.get() - before == n
            await call.done_writing()
    finally:
        await fleet.stop()
