"""One tenant holds at most three quarters of the controller's open RPCs (--grpc-max-concurrent-rpcs).

Real controller, real gRPC on loopback. NOTE: before, only some calls had a per-tenant bound of their own (uploads,
gets, session calls); a tenant's RouteStreams left open, or its JudgeToolResults waiting in its judge lane (up to
1,024 jobs), each held one of the server's slots, and past the server's cap gRPC refused every other tenant's calls
("Concurrent RPC limit exceeded"; review finding). The control below puts the old bound back on the same controller.
"""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import grpc
from support.controller import make_tokens, md, start_controller, store_url
from support.waits import wait_until

from controller.edge import GrpcLimits
from fleet.api.kvfleet.v1 import blobs_pb2
from fleet.api.kvfleet.v1 import route_pb2 as pb
from fleet.api.kvfleet.v1.blobs_pb2_grpc import BlobServiceStub
from fleet.api.kvfleet.v1.route_pb2_grpc import RouteServiceStub

Code = grpc.StatusCode


async def _ended(call: grpc.aio.StreamStreamCall) -> tuple[grpc.StatusCode, str]:
    """How a RouteStream that sends nothing ends: a held one only when it is cancelled."""
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details() or ""
    except asyncio.CancelledError:  # the call (not this task) was cancelled: grpc raises it from the read
        return Code.CANCELLED, ""
    return Code.OK, ""


async def _stat(stub: BlobServiceStub, token: str) -> tuple[grpc.StatusCode, str]:
    try:
        await stub.StatBlob(blobs_pb2.StatBlobRequest(ref=hashlib.sha256(b"x").hexdigest()), metadata=md(token),
                            timeout=10)
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details() or ""
    return Code.OK, ""


async def test_one_tenants_open_calls_leave_the_others_a_quarter_of_the_server(tmp_path: Path) -> None:
    tok = make_tokens(tmp_path)
    ctl = await start_controller(store_url("sqlite", tmp_path), tok, grpc_limits=GrpcLimits(max_concurrent_rpcs=16))
    shares = ctl.ctx.rpc_shares
    calls: list[grpc.aio.StreamStreamCall] = []
    try:
        async with grpc.aio.insecure_channel(ctl.address) as ch:
            routes, blobs = RouteServiceStub(ch), BlobServiceStub(ch)

            def stream() -> asyncio.Future[tuple[grpc.StatusCode, str]]:
                calls.append(routes.RouteStream(metadata=md(tok.a)))
                return asyncio.ensure_future(_ended(calls[-1]))

            ends = [stream() for _ in range(16)]
            await wait_until(lambda: shares.held.get("acme", 0) + sum(f.done() for f in ends) == 16,
                         "every stream held or refused")
            held, refused = shares.held["acme"], [f.result() for f in ends if f.done()]
            acme_stat = await _stat(blobs, tok.a)          # a unary call of acme's is refused by its share too
            bravo_stat = await _stat(blobs, tok.b)         # another tenant is served
            bravo_route = await routes.RouteStream(iter([pb.RouteStreamRequest(id=1, route=pb.RouteRequest(
                token_ids=[1, 2, 3], model="m"))]), metadata=md(tok.b)).read()

            # control: the old bound (a tenant may hold the whole server): acme takes every slot, bravo is refused
            shares.per_tenant = 16
            more = [stream() for _ in range(4)]
            await wait_until(lambda: shares.held.get("acme", 0) == 16, "acme holds the whole server")
            control = await _stat(blobs, tok.b)
            for c in calls:
                c.cancel()
            await asyncio.gather(*ends, *more)
            await wait_until(lambda: not shares.held, "every slot given back")
    finally:
        await ctl.stop()
    print(f"acme held {held}, refused {len(refused)}; bravo {bravo_stat[0].name}; control {control}")
    assert held == 12 and len(refused) == 4, (held, refused)
    assert all(c is Code.RESOURCE_EXHAUSTED and "three quarters of --grpc-max-concurrent-rpcs 16" in d
               for c, d in refused), refused
    assert acme_stat[0] is Code.RESOURCE_EXHAUSTED, acme_stat
    assert bravo_stat[0] is Code.NOT_FOUND, bravo_stat            # served: no such blob
    assert bravo_route.error.code == "UNAVAILABLE" and "router is not running" in bravo_route.error.message, \
        bravo_route                                               # served: this controller runs no router
    assert control[0] is Code.RESOURCE_EXHAUSTED and "Concurrent RPC limit exceeded" in control[1], control


async def test_with_auth_off_the_one_identity_may_hold_the_whole_server(tmp_path: Path) -> None:
    """Every caller is one identity without a tokens file: its share is every slot (three quarters would only have
    cut a single-tenant server to 12 of 16 here); with tokens, three quarters."""
    for tokens, share in ((None, 16), (make_tokens(tmp_path), 12)):
        ctl = await start_controller(store_url("sqlite", tmp_path), tokens, grpc_limits=GrpcLimits(max_concurrent_rpcs=16))
        try:
            assert ctl.ctx.rpc_shares.per_tenant == share
        finally:
            await ctl.stop()
