"""A PutBlob whose header names a malformed expected_ref (another case, a prefix, not hex) is refused as the header
arrives, before any chunk is received or any upload budget held.

NOTE: before, the store checked it once every byte had arrived: a client announcing 8 MiB under an upper-case ref
got its INVALID_ARGUMENT only after sending all of it, its upload held the tenant's budget meanwhile, and a client
still sending (here: one that pauses after the header) was answered nothing until it finished.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from support.controller import make_tokens, md, start_controller, store_url

from fleet.api.kvfleet.v1 import blobs_pb2
from fleet.api.kvfleet.v1.blobs_pb2_grpc import BlobServiceStub

DATA = b"tool result " * 1000
REF = hashlib.sha256(DATA).hexdigest()


async def _put(stub: BlobServiceStub, token: str, expected_ref: str, pause_s: float,
               timeout_s: float) -> grpc.aio.AioRpcError | str:
    """A put of DATA that sends its header, pauses `pause_s` (a client still uploading), then its bytes."""
    async def reqs() -> AsyncIterator[blobs_pb2.PutBlobRequest]:
        yield blobs_pb2.PutBlobRequest(header=blobs_pb2.PutBlobHeader(size=len(DATA), expected_ref=expected_ref))
        await asyncio.sleep(pause_s)
        yield blobs_pb2.PutBlobRequest(chunk=DATA)

    try:
        return str((await stub.PutBlob(reqs(), metadata=md(token), timeout=timeout_s)).ref)
    except grpc.aio.AioRpcError as e:
        return e


@pytest.mark.parametrize("bad", [REF.upper(), REF[:63], "g" * 64, f" {REF}"])
async def test_a_malformed_expected_ref_is_refused_as_the_header_arrives(tmp_path: Path, bad: str) -> None:
    tok = make_tokens(tmp_path)
    ctl = await start_controller(store_url("sqlite", tmp_path), tok)
    try:
        async with grpc.aio.insecure_channel(ctl.address) as ch:
            got = await _put(BlobServiceStub(ch), tok.a, bad, pause_s=6.0, timeout_s=3.0)
        assert isinstance(got, grpc.aio.AioRpcError), got
        assert got.code() == grpc.StatusCode.INVALID_ARGUMENT, (got.code(), got.details())
        assert "malformed ref" in (got.details() or "") and "64 lowercase hex" in (got.details() or "")
        assert ctl.ctx.uploads.total_open == 0 and ctl.ctx.store.stored_bytes("acme") == 0
    finally:
        await ctl.stop()


async def test_control_the_right_ref_is_stored_after_the_pause(tmp_path: Path) -> None:
    tok = make_tokens(tmp_path)
    ctl = await start_controller(store_url("sqlite", tmp_path), tok)
    try:
        async with grpc.aio.insecure_channel(ctl.address) as ch:
            got = await _put(BlobServiceStub(ch), tok.a, REF, pause_s=0.5, timeout_s=10.0)
        assert got == REF, got
        assert ctl.ctx.store.get(REF, "acme") == DATA
    finally:
        await ctl.stop()
