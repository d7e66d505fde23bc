"""A put counts against the upload gate from its start, not from its header.

Real controller, real gRPC on loopback. NOTE: before the fix, a PutBlob waiting for its header (up to
--upload-idle-timeout) was outside the gate's counts while it held one of the server's RPC slots: one tenant's
16 header-less puts took all of a --grpc-max-concurrent-rpcs of 16, and another tenant's put and stat were
refused ("Concurrent RPC limit exceeded!"). Now the tenant's 9th header-less put is refused at once
(--max-uploads-per-tenant=8) and the other tenant is served.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
from support.controller import make_tokens, md, start_controller, store_url

from controller.edge import GrpcLimits
from controller.uploads import UploadLimits
from fleet.api.kvfleet.v1 import blobs_pb2
from fleet.api.kvfleet.v1.blobs_pb2_grpc import BlobServiceStub

Code = grpc.StatusCode


def _header(data: bytes) -> blobs_pb2.PutBlobRequest:
    ref = hashlib.sha256(data).hexdigest()
    return blobs_pb2.PutBlobRequest(header=blobs_pb2.PutBlobHeader(size=len(data), expected_ref=ref))


async def _code(call: object) -> tuple[grpc.StatusCode, str]:
    try:
        await call  # type: ignore[misc]
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details() or ""
    return Code.OK, ""


async def test_header_less_puts_cannot_take_the_servers_rpc_slots(tmp_path: Path) -> None:
    tok = make_tokens(tmp_path)
    ctl = await start_controller(store_url("sqlite", tmp_path), tok, uploads=UploadLimits(idle_s=20.0),
                                 grpc_limits=GrpcLimits(max_concurrent_rpcs=16))
    gate, go, data = ctl.ctx.uploads, asyncio.Event(), b"late header"
    try:
        async with grpc.aio.insecure_channel(ctl.address) as ch:
            stub = BlobServiceStub(ch)

            async def header_later() -> AsyncIterator[blobs_pb2.PutBlobRequest]:
                await go.wait()
                yield _header(data)
                yield blobs_pb2.PutBlobRequest(chunk=data)

            held = [asyncio.ensure_future(_code(stub.PutBlob(header_later(), metadata=md(tok.a), timeout=30)))
                    for _ in range(16)]
            for _ in range(200):  # every put counted by the gate or refused
                if sum(f.done() for f in held) + gate.uploads["acme"] == len(held):
                    break
                await asyncio.sleep(0.01)
            counted, refused = gate.uploads["acme"], [f.result() for f in held if f.done()]
            other = await _code(stub.PutBlob(iter([_header(b"bravo"), blobs_pb2.PutBlobRequest(chunk=b"bravo")]),
                                             metadata=md(tok.b), timeout=10))
            stat = await _code(stub.StatBlob(blobs_pb2.StatBlobRequest(ref=hashlib.sha256(b"bravo").hexdigest()),
                                             metadata=md(tok.b), timeout=10))
            go.set()  # control: the counted puts still store their blob once their header comes
            ends = await asyncio.gather(*held)
    finally:
        await ctl.stop()
    assert other == (Code.OK, ""), other
    assert stat == (Code.OK, ""), stat
    assert counted == 8, counted
    assert len(refused) == 8 and all(c is Code.RESOURCE_EXHAUSTED and "--max-uploads-per-tenant=8" in d
                                     for c, d in refused), refused
    assert sorted(c.name for c, _ in ends) == ["OK"] * 8 + ["RESOURCE_EXHAUSTED"] * 8, ends
    assert gate.total_uploads == 0 and gate.total_bytes == 0
