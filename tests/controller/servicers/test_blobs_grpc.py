"""Blobs over gRPC: chunked put/get, tenant isolation, size limit and hash checks that write nothing."""

from __future__ import annotations

import asyncio
import hashlib
import os
from pathlib import Path

import grpc
import pytest
from support.controller import make_tokens, md, start_controller

from fleet.api.kvfleet.v1 import blobs_pb2
from fleet.api.kvfleet.v1.blobs_pb2_grpc import BlobServiceStub
from fleet.core.errors import InvalidArgument, NotFound, ResourceExhausted
from fleet.sdk import NO_RETRY, AsyncFleetClient, FleetClient


def _absent(ctl, data: bytes, tenant: str) -> bool:
    try:
        ctl.ctx.store.stat(hashlib.sha256(data).hexdigest(), tenant)
    except NotFound:
        return True
    return False


async def test_chunked_roundtrip_20mib(url: str, tmp_path: Path) -> None:
    tok = make_tokens(tmp_path)
    ctl = await start_controller(url, tok)
    try:
        data = os.urandom(20 << 20)
        async with AsyncFleetClient(ctl.address, token=tok.a, retry=NO_RETRY) as c:
            ref = await c.put_blob(data)
            assert ref.ref == hashlib.sha256(data).hexdigest() and ref.size == len(data)
            got = await c.get_blob(ref)
            info = await c.stat_blob(ref)
        assert info.size == len(data) and info.ref == ref.ref
        delta = sum(a != b for a, b in zip(got, data, strict=True))
        print(f"20 MiB round trip: {len(got)} bytes, differing bytes = {delta}")
        assert got == data
        async with grpc.aio.insecure_channel(ctl.address) as ch:  # the server streams it in >1 chunk
            n = len([m async for m in BlobServiceStub(ch).GetBlob(blobs_pb2.GetBlobRequest(ref=ref.ref), metadata=md(tok.a))])
            assert n == 20

            async def one_big():  # control: why chunks exist - one 5 MiB message is refused by gRPC itself
                yield blobs_pb2.PutBlobRequest(header=blobs_pb2.PutBlobHeader(size=5 << 20))
                yield blobs_pb2.PutBlobRequest(chunk=data[: 5 << 20])
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await BlobServiceStub(ch).PutBlob(one_big(), metadata=md(tok.a))
            print("one 5 MiB message:", ei.value.code().name)
            assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        await ctl.stop(0)


async def test_tenant_isolation(url: str, tmp_path: Path) -> None:
    tok = make_tokens(tmp_path)
    ctl = await start_controller(url, tok)
    try:
        await asyncio.to_thread(_isolation, ctl.address, tok)
    finally:
        await ctl.stop(0)


def _isolation(address: str, tok) -> None:
    """Sync clients, run in a thread (the server shares the test's event loop)."""
    with FleetClient(address, token=tok.a, retry=NO_RETRY) as a, \
         FleetClient(address, token=tok.b, retry=NO_RETRY) as b:
        ref = a.put_blob(b"acme's secret tool output")
        assert a.get_blob(ref) == b"acme's secret tool output"
        random_ref = hashlib.sha256(b"never stored").hexdigest()
        msgs = {}
        for label, r in (("other tenant's", ref.ref), ("random", random_ref)):
            for op in (b.get_blob, b.stat_blob):
                with pytest.raises(NotFound) as ei:
                    op(r)
                msgs[(label, op.__name__)] = str(ei.value).replace(r, "<ref>")
        print(msgs)
        assert msgs[("other tenant's", "get_blob")] == msgs[("random", "get_blob")]
        assert msgs[("other tenant's", "stat_blob")] == msgs[("random", "stat_blob")]
        # the same bytes put by B become B's own object; A's is untouched
        assert b.put_blob(b"acme's secret tool output").ref == ref.ref and b.get_blob(ref) == a.get_blob(ref)


async def test_oversize_is_refused_and_nothing_written(url: str, tmp_path: Path) -> None:
    tok = make_tokens(tmp_path)
    ctl = await start_controller(url, tok, max_blob_bytes=1 << 20)
    try:
        big, fits = os.urandom((1 << 20) + 1), os.urandom(1 << 20)
        async with AsyncFleetClient(ctl.address, token=tok.a, retry=NO_RETRY) as c:
            with pytest.raises(ResourceExhausted, match="exceeds the store limit of 1048576 bytes"):
                await c.put_blob(big)
            assert _absent(ctl, big, "acme")
            assert (await c.put_blob(fits)).size == 1 << 20  # control: at the limit it is stored
            assert not _absent(ctl, fits, "acme")
    finally:
        await ctl.stop(0)


async def test_hash_mismatch_and_bad_streams_write_nothing(url: str, tmp_path: Path) -> None:
    tok = make_tokens(tmp_path)
    ctl = await start_controller(url, tok)
    try:
        data = b"x" * 3_000_000
        async with AsyncFleetClient(ctl.address, token=tok.a, retry=NO_RETRY) as c:
            with pytest.raises(InvalidArgument) as ei:
                await c.put_blob(data, expected_ref=hashlib.sha256(b"something else").hexdigest())
            print("mismatch:", ei.value)
            assert _absent(ctl, data, "acme")
            with pytest.raises(InvalidArgument):
                await c.get_blob("not-a-ref")
        async with grpc.aio.insecure_channel(ctl.address) as ch:
            stub = BlobServiceStub(ch)

            async def stream(size: int, chunks: list[bytes], header: bool = True):
                if header:
                    yield blobs_pb2.PutBlobRequest(header=blobs_pb2.PutBlobHeader(size=size))
                for ch_ in chunks:
                    yield blobs_pb2.PutBlobRequest(chunk=ch_)
            cases = {"truncated": stream(len(data), [data[:1000]]), "overlong": stream(10, [data[:1000]]),
                     "no header": stream(0, [data[:10]], header=False)}
            for label, reqs in cases.items():
                with pytest.raises(grpc.aio.AioRpcError) as ei:
                    await stub.PutBlob(reqs, metadata=md(tok.a))
                print(label, ei.value.code().name, ei.value.details())
                assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            for piece in (data[:1000], data[:10]):
                assert _absent(ctl, piece, "acme")
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                [m async for m in stub.GetBlob(blobs_pb2.GetBlobRequest(ref="0" * 64, chunk_size=64 << 20), metadata=md(tok.a))]
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            r = await stub.PutBlob(stream(1000, [data[:1000]]), metadata=md(tok.a))  # control: a good stream
            assert r.ref == hashlib.sha256(data[:1000]).hexdigest() and not _absent(ctl, data[:1000], "acme")
    finally:
        await ctl.stop(0)
