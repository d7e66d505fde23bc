"""grpc.aio replaces a client-streaming call's status with INTERNAL "Internal error from Core" when a write in
flight fails after the server ended the call; the async SDK reports the server's status (fleet/sdk/aio_status.py).

The replacement is a race (about 1 in 1,200 oversized puts under load); here grpc.aio's own replacement
(`set_internal_error`, what its failed write calls) is made to happen at a known point, after the server's status.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from support.controller import make_tokens, md, start_controller

from fleet.api.kvfleet.v1 import blobs_pb2
from fleet.api.kvfleet.v1.blobs_pb2_grpc import BlobServiceStub
from fleet.sdk import aio_status


async def _refused_put(tmp_path: Path, watch: bool) -> grpc.RpcError:
    """An oversized PutBlob the controller refuses, whose status grpc.aio then replaces as a failed write does."""
    tok = make_tokens(tmp_path)
    ctl = await start_controller(f"sqlite:///{tmp_path / 'kvfleet.db'}", tok, max_blob_bytes=1 << 10)
    try:
        async with grpc.aio.insecure_channel(ctl.address) as ch:
            header = blobs_pb2.PutBlobRequest(header=blobs_pb2.PutBlobHeader(size=(1 << 10) + 1))
            call = BlobServiceStub(ch).PutBlob(iter([header]), metadata=md(tok.a), timeout=10)
            first = aio_status.first_status(call) if watch else (lambda: None)
            while not call.done():
                await asyncio.sleep(0.005)
            call._cython_call.set_internal_error("send failed after the server ended the call")
            try:
                await call
            except grpc.RpcError as e:
                return aio_status.server_error(e, first())
            raise AssertionError("an oversized put was stored")
    finally:
        await ctl.stop(0)


async def test_the_servers_status_is_reported_over_grpc_aios_own_internal(tmp_path: Path) -> None:
    e = await _refused_put(tmp_path, watch=True)
    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (e.code(), e.details())
    assert "exceeds the store limit of 1024 bytes" in e.details()


async def test_control_unwatched_the_call_ends_internal(tmp_path: Path) -> None:
    """Control: without first_status, the replaced status is what awaiting the call raises."""
    e = await _refused_put(tmp_path, watch=False)
    assert (e.code(), e.details()) == (grpc.StatusCode.INTERNAL, "Internal error from Core")


@pytest.mark.parametrize("code", [grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE])
def test_other_errors_pass_through(code: grpc.StatusCode) -> None:
    e = grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), "the server's own words")
    assert aio_status.server_error(e, None) is e
