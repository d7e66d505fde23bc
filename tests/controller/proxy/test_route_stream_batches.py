"""RouteStream batches: messages that queue while the proxy's last write is in flight go in its next write together
(`more`), and the controller answers several in one to a caller that says it reads them (controller/proxy/token_stream.py,
controller/servicers/route.py, docs/proxy.md "RouteStream batches"). Real controller, sims and proxy on loopback.

NOTE: before, every message was a write of its own each way: under load a write (and its read on the other side) cost
the proxy and the controller about as much CPU as the routing it carried.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import grpc
import pytest
from support.proxy_fleet import MODEL, linked_fleet

from controller import stream_batch
from controller.edge import GrpcLimits
from controller.proxy import token_stream
from controller.servicers import route as route_servicer
from controller.servicers.route import BATCHED
from controller.stream_batch import route_bytes
from fleet.api.kvfleet.v1 import route_pb2 as pb

N = 6


def _count(counter: Any) -> float:
    return float(counter._value.get())



async def _six_at_once(tmp_path: Path) -> tuple[float, float, list[str]]:
    """Six routes asked in one event-loop turn on an open stream: (writes the controller read, messages, workers)."""
    async with linked_fleet(tmp_path) as (fleet, control):
        metrics, token = fleet.ctl.ctx.metrics, fleet.tokens["a"]
        await control.route([9, 9, 9], MODEL, lora=None, token=token)  # the stream is open and its metadata read
        reads, msgs = metrics.route_stream_writes.labels("received"), metrics.route_stream_messages.labels("received")
        r0, m0 = _count(reads), _count(msgs)
        asked = await asyncio.gather(*(control.route([i + 1] * 20, MODEL, lora=None, token=token) for i in range(N)))
        return _count(reads) - r0, _count(msgs) - m0, [d.worker for d in asked]


async def test_routes_queued_while_a_write_is_out_go_in_one_write(tmp_path: Path) -> None:
    writes, messages, workers = await _six_at_once(tmp_path)
    print(f"{N} routes asked at once: {messages:.0f} messages in {writes:.0f} write(s) (before: {N} writes)")
    assert messages == N and all(workers)  # each answered as if it had come alone
    assert writes < N  # the write carries what queued behind its first message (here all six go in one)


async def test_control_a_controller_that_does_not_say_batched_gets_each_message_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the controller announces (and looks for) another value: the proxy must not send `more` it would drop
    monkeypatch.setattr(route_servicer, "BATCHED", ("kvfleet-route-stream", "not-batched"))
    writes, messages, workers = await _six_at_once(tmp_path)
    assert (writes, messages) == (N, N) and all(workers)


async def test_the_controller_answers_every_message_of_a_batch_and_refuses_a_nested_one(tmp_path: Path) -> None:
    async with linked_fleet(tmp_path) as (fleet, control):
        token, metrics = fleet.tokens["a"], fleet.ctl.ctx.metrics
        call = control._route.RouteStream(metadata=(("authorization", f"Bearer {token}"), BATCHED))
        try:
            assert BATCHED in tuple(await call.initial_metadata())
            head = pb.RouteStreamRequest(id=1, route=pb.RouteRequest(token_ids=[1] * 20, model=MODEL))
            for i in range(2, 12):
                head.more.add(id=i, route=pb.RouteRequest(token_ids=[i] * 20, model=MODEL))
            nested = head.more.add(id=12, route=pb.RouteRequest(token_ids=[3] * 20, model=MODEL))
            nested.more.add(id=13, route=pb.RouteRequest(token_ids=[4] * 20, model=MODEL))  # never run
            written0 = _count(metrics.route_stream_writes.labels("answered"))
            await call.write(head)
            got: dict[int, pb.RouteStreamResponse] = {}
            while len(got) < 12:
                out = await asyncio.wait_for(call.read(), 5.0)
                for one in (out, *out.more):
                    got[one.id] = one
            assert sorted(got) == list(range(1, 13))
            assert all(got[i].WhichOneof("result") == "route" and got[i].route.worker for i in range(1, 12))
            assert (got[12].WhichOneof("result"), got[12].error.code) == ("error", "INVALID_ARGUMENT")
            assert "carries no `more`" in got[12].error.message
            # 12 answers finished in the same turn of the controller's loop go out together
            assert _count(metrics.route_stream_writes.labels("answered")) - written0 < 12
        finally:
            call.cancel()


async def test_a_caller_that_does_not_say_it_reads_batches_gets_each_answer_alone(tmp_path: Path) -> None:
    async with linked_fleet(tmp_path) as (fleet, control):
        token = fleet.tokens["a"]
        call = control._route.RouteStream(metadata=(("authorization", f"Bearer {token}"),))  # a proxy from before
        try:
            for i in range(1, 7):
                await call.write(pb.RouteStreamRequest(id=i, route=pb.RouteRequest(token_ids=[i] * 20, model=MODEL)))
            outs = [await asyncio.wait_for(call.read(), 5.0) for _ in range(6)]
            assert sorted(o.id for o in outs) == list(range(1, 7)) and not any(o.more for o in outs)
        finally:
            call.cancel()


async def test_long_routes_asked_at_once_stay_under_the_controllers_receive_limit(tmp_path: Path) -> None:
    # six Routes of 250k tokens (750 kB each): together over the controller's default receive limit, each alone under
    # NOTE: before, they went in one write of 4.5 MB; the controller refused it and ended the stream: all six failed
    # RESOURCE_EXHAUSTED ("Received message larger than max")
    ids = [[100_000 + i] * 250_000 for i in range(N)]
    sizes = [pb.RouteStreamRequest(route=pb.RouteRequest(token_ids=t, model=MODEL)).ByteSize() for t in ids]
    assert max(sizes) < GrpcLimits().max_receive_bytes < sum(sizes)  # control: one batch of them would be refused
    async with linked_fleet(tmp_path) as (fleet, control):
        # NOTE: hashing six 250k-token prompts took the controller past the client's 2 s in two loaded fresh-clone
        # runs (load average 26-33); this test is about message sizes, not latency
        control.timeout_s = 30.0
        token = fleet.tokens["a"]
        await control.route([9, 9, 9], MODEL, lora=None, token=token)  # the stream is open and says batched
        asked = await asyncio.gather(*(control.route(t, MODEL, lora=None, token=token) for t in ids),
                                     return_exceptions=True)
        assert [type(d).__name__ for d in asked] == ["RouteDecision"] * N, asked
        assert (await control.route([9, 9, 9, 9], MODEL, lora=None, token=token)).worker  # the stream goes on


async def test_a_message_carrying_more_than_a_batch_ends_the_stream_with_a_clear_error(tmp_path: Path) -> None:
    # a hostile (or broken) caller: 10,000 messages in one's `more` (20 kB), where the proxy sends at most 31
    # NOTE: before, each was made a Python object and run (1.4M in 2.7 MB: 300 MB and 0.75 s of the controller's loop)
    async with linked_fleet(tmp_path) as (fleet, control):
        token, metrics = fleet.tokens["a"], fleet.ctl.ctx.metrics
        received = metrics.route_stream_messages.labels("received")
        call = control._route.RouteStream(metadata=(("authorization", f"Bearer {token}"), BATCHED))
        try:
            await call.initial_metadata()
            head = pb.RouteStreamRequest(id=1, route=pb.RouteRequest(token_ids=[1] * 20, model=MODEL))
            for i in range(2, 10_002):
                head.more.add(id=i)
            r0 = _count(received)
            await call.write(head)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await asyncio.wait_for(call.read(), 5.0)  # before: the answers (errors: no op) came
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "at most 31 others in `more`, got 10000" in (e.value.details() or "")
            assert _count(received) == r0  # none of them ran
        finally:
            call.cancel()
        # control: a batch within the bound on a new stream is answered
        ok = pb.RouteStreamRequest(id=1, route=pb.RouteRequest(token_ids=[1] * 20, model=MODEL))
        for i in range(2, 33):
            ok.more.add(id=i, route=pb.RouteRequest(token_ids=[i] * 20, model=MODEL))
        call = control._route.RouteStream(metadata=(("authorization", f"Bearer {token}"), BATCHED))
        try:
            await call.write(ok)
            got: set[int] = set()
            while len(got) < 32:
                out = await asyncio.wait_for(call.read(), 5.0)
                got |= {one.id for one in (out, *out.more) if one.WhichOneof("result") == "route"}
        finally:
            call.cancel()


async def test_a_message_carrying_too_many_releases_ends_the_stream_with_a_clear_error(tmp_path: Path) -> None:
    # NOTE: before, each was run (1M empty ones in a 1.9 MB message: seconds of the controller's loop), each refused
    async with linked_fleet(tmp_path) as (fleet, control):
        token, received = fleet.tokens["a"], fleet.ctl.ctx.metrics.route_stream_messages.labels("received")
        call = control._route.RouteStream(metadata=(("authorization", f"Bearer {token}"), BATCHED))
        try:
            await call.initial_metadata()
            head = pb.RouteStreamRequest(id=1, route=pb.RouteRequest(token_ids=[1] * 20, model=MODEL))
            head.more.add(id=2).releases.extend(pb.ReleaseRouteRequest() for _ in range(5000))
            r0 = _count(received)
            await call.write(head)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await asyncio.wait_for(call.read(), 5.0)  # before: the answers came, 5000 released = False
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "at most 4096 releases, got 5000" in (e.value.details() or "")
            assert _count(received) == r0  # none of the batch ran
        finally:
            call.cancel()


async def test_releases_queued_past_what_one_message_carries_go_on_the_next(tmp_path: Path) -> None:
    # 5000 releases queued at once (made-up route ids: each answered unknown)
    # NOTE: before, all went on one message, which the controller refuses: the stream ended, each release failed
    async with linked_fleet(tmp_path) as (fleet, control):
        token, metrics = fleet.tokens["a"], fleet.ctl.ctx.metrics
        await control.route([9, 9, 9], MODEL, lora=None, token=token)  # the stream is open and takes releases
        outcomes: list[str] = []
        m0 = _count(metrics.route_stream_messages.labels("received"))
        for i in range(5000):
            control.release_soon(f"{i:032x}", token, outcomes.append)
        await control._streams.drain(10.0)
        assert len(outcomes) == 5000 and set(outcomes) == {"unknown"}, set(outcomes)
        assert _count(metrics.route_stream_messages.labels("received")) - m0 == 5  # 1024 a message
        assert (await control.route([9, 9, 9, 9], MODEL, lora=None, token=token)).worker  # the stream goes on


def test_the_batch_bounds_agree() -> None:
    assert token_stream.BATCHED == route_servicer.BATCHED
    assert token_stream.MAX_CARRIED <= route_servicer.MAX_CARRIED
    assert stream_batch.MAX_BATCH <= route_servicer.STREAM_IN_FLIGHT


def test_a_routes_size_bound_is_never_below_its_encoded_size() -> None:
    """`route_bytes` sizes a Route without encoding its ids (ByteSize costs a full encode); a bound below the real size
    could let a batch past the controller's receive limit. Where the bounds go past the limit the batch is measured:
    32 Routes of 2,000 small ids (2 KB each, bound 10 KB) still go in one write; of 9,000 (9 KB each), as many as fit."""
    rng = random.Random(7)
    for n in (0, 1, 200, 2000):
        for top in (1, 1 << 17, (1 << 32) - 1):  # token ids of 1, 3 and 5 varint bytes
            route = pb.RouteRequest(token_ids=[rng.randrange(top) for _ in range(n)], model="m" * rng.randrange(300),
                                    track=True, probe=True)
            if n % 2:
                route.lora, route.client_salt = "ä-adapter" * 20, "\U0001f511" * 256  # 2- and 4-byte characters
            msg = pb.RouteStreamRequest(id=(1 << 64) - 1, route=route)
            assert route_bytes(msg) >= msg.ByteSize(), (n, top)
    for n in (2000, 9000):
        first = pb.RouteStreamRequest(id=1, route=pb.RouteRequest(token_ids=[100] * n, model=MODEL, track=True))
        batch, one = stream_batch.Batch(first, route_bytes), pb.RouteStreamRequest()
        one.CopyFrom(first)
        while batch.take(one):
            first.more.append(one)
        assert batch.n == len(first.more) + 1 and first.ByteSize() <= stream_batch.MAX_BATCH_BYTES
        if n == 2000:
            assert batch.n == stream_batch.MAX_BATCH
        else:  # as many as fit: one more would go past the bound
            assert first.ByteSize() + one.ByteSize() + stream_batch.IN_MORE > stream_batch.MAX_BATCH_BYTES


async def test_the_controllers_batched_answers_stay_within_its_byte_bound(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the bound below one answer's size, twelve answers finished together go in twelve writes, every one
    answered (NOTE: unbounded before, 32 answers of a fleet of ~2,200 ranks went over the proxy's receive limit)."""
    monkeypatch.setattr(stream_batch, "MAX_BATCH_BYTES", 1)
    async with linked_fleet(tmp_path) as (fleet, control):
        token, metrics = fleet.tokens["a"], fleet.ctl.ctx.metrics
        call = control._route.RouteStream(metadata=(("authorization", f"Bearer {token}"), BATCHED))
        try:
            head = pb.RouteStreamRequest(id=1, route=pb.RouteRequest(token_ids=[1] * 20, model=MODEL))
            for i in range(2, 13):
                head.more.add(id=i, route=pb.RouteRequest(token_ids=[i] * 20, model=MODEL))
            written0 = _count(metrics.route_stream_writes.labels("answered"))
            await call.write(head)
            outs = [await asyncio.wait_for(call.read(), 5.0) for _ in range(12)]
            assert sorted(o.id for o in outs) == list(range(1, 13)) and not any(o.more for o in outs)
            assert all(o.route.worker for o in outs)
            assert _count(metrics.route_stream_writes.labels("answered")) - written0 == 12
        finally:
            call.cancel()
