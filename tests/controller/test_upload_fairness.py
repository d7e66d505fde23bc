"""Unfinished uploads cannot hold the controller's upload budget (issue #31 item 3), and an upload's
clock runs only while the client is the one holding it up (issue #28 item 3).

Real controller, real gRPC on loopback. NOTE: before the fix, 4 tenants each holding 4 uploads that
announce 64 MiB and send 1 byte per idle period held the whole global budget (1 GiB) for as long as
they liked: a fifth tenant's 16-byte put was RESOURCE_EXHAUSTED. And a put whose server waited for
a store thread longer than the idle timeout failed "made no progress", though its client had sent
everything.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from pathlib import Path

import grpc
import pytest
from support.controller import make_tokens, md, start_controller, store_url

from controller.auth import mint_token
from controller.uploads import UploadLimits
from fleet.api.kvfleet.v1 import blobs_pb2
from fleet.api.kvfleet.v1.blobs_pb2_grpc import BlobServiceStub

Code = grpc.StatusCode
MIB = 1 << 20


async def _trickle(
    stub: BlobServiceStub, token: str, size: int, every_s: float
) -> tuple[grpc.StatusCode, str, float]:
    """A put that announces `size` bytes and sends one byte every `every_s` (within the idle timeout)."""
    t0 = time.monotonic()

    async def reqs():  # type: ignore[no-untyped-def]
        yield blobs_pb2.PutBlobRequest(header=blobs_pb2.PutBlobHeader(size=size))
        for _ in range(size):
            yield blobs_pb2.PutBlobRequest(chunk=b"x")
            await asyncio.sleep(every_s)

    try:
        await stub.PutBlob(reqs(), metadata=md(token), timeout=60)
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details() or "", time.monotonic() - t0
    return Code.OK, "", time.monotonic() - t0


async def _put(stub: BlobServiceStub, data: bytes, token: str) -> tuple[grpc.StatusCode, str]:
    async def reqs():  # type: ignore[no-untyped-def]
        ref = hashlib.sha256(data).hexdigest()
        yield blobs_pb2.PutBlobRequest(header=blobs_pb2.PutBlobHeader(size=len(data), expected_ref=ref))
        yield blobs_pb2.PutBlobRequest(chunk=data)

    try:
        await stub.PutBlob(reqs(), metadata=md(token), timeout=30)
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details() or ""
    return Code.OK, ""


async def test_four_trickling_tenants_cannot_hold_the_upload_budget(tmp_path: Path) -> None:
    tok = make_tokens(tmp_path)
    tenants = [tok.a, tok.b] + [mint_token(tok.file, f"t{i}", "tenant") for i in range(3)]
    ctl = await start_controller(store_url("sqlite", tmp_path), tok, uploads=UploadLimits(idle_s=1.0))
    gate = ctl.ctx.uploads
    try:
        async with grpc.aio.insecure_channel(ctl.address) as ch:
            stub = BlobServiceStub(ch)
            held = [
                asyncio.ensure_future(_trickle(stub, t, 64 * MIB, 0.5)) for t in tenants[:4] for _ in range(4)
            ]
            for _ in range(100):  # every upload admitted or refused
                if sum(f.done() for f in held) + gate.total_uploads == len(held):
                    break
                await asyncio.sleep(0.01)
            reserved = gate.total_bytes
            fifth = await _put(stub, b"y" * 16, tenants[4])  # while the trickles are open
            ends = await asyncio.gather(*held)
            after = (gate.total_uploads, gate.total_bytes)
    finally:
        await ctl.stop(0)
    print(f"reserved {reserved / MIB:.0f} MiB; fifth tenant: {fifth[0].name} {fifth[1][:120]}")
    for code, details, took in ends:
        print(f"  {code.name} after {took:.1f}s: {details[:140]}")
    assert fifth[0] == Code.OK, f"a fifth tenant's 16-byte put was refused: {fifth}"
    assert reserved < 1 << 30  # the four tenants could not reserve the whole budget
    assert not [e for e in ends if e[0] == Code.OK]
    # NOTE: a client still writing when the server ends its call now and then reads gRPC's own
    # "Internal error from Core" instead of the status (grpc.aio marks a failed write as the call's
    # status), so the outcomes are counted where the server decided them
    outcome = {o: ctl.ctx.metrics.registry.get_sample_value("kvfleet_cas_ops_total", {"op": "put", "outcome": o})
               or 0.0 for o in ("stalled", "upload_budget", "ok")}
    print(outcome)
    assert outcome["stalled"] >= 8 and outcome["upload_budget"] >= 1 and outcome["ok"] == 1  # the fifth's put
    assert outcome["stalled"] + outcome["upload_budget"] == len(held)
    assert max(took for _, _, took in ends) < 5.0  # 1 s idle grace, then the rate: not indefinitely
    assert after == (0, 0)


async def test_eight_tenants_at_their_cap_leave_a_ninth_an_upload_slot(tmp_path: Path) -> None:
    """8 tenants each open 8 header-only puts (their cap; 16 bytes each, 1 KiB in all), one tenant after the
    other: the eighth gets only 4 (half of the 8 the seven before leave), so a ninth tenant's put goes
    through. NOTE: before the count share, the 64 held every slot of --max-uploads and the ninth was refused."""
    tok = make_tokens(tmp_path)
    tenants = [mint_token(tok.file, f"t{i}", "tenant") for i in range(8)]
    ctl = await start_controller(store_url("sqlite", tmp_path), tok)  # the default limits: 64 in all, 8 each
    gate = ctl.ctx.uploads
    release = asyncio.Event()

    async def hold(token: str) -> tuple[grpc.StatusCode, str]:
        async def reqs():  # type: ignore[no-untyped-def]
            yield blobs_pb2.PutBlobRequest(header=blobs_pb2.PutBlobHeader(size=16))
            await release.wait()

        try:
            await stub.PutBlob(reqs(), metadata=md(token), timeout=30)
        except grpc.aio.AioRpcError as e:
            return e.code(), e.details() or ""
        return Code.OK, ""

    held: list[asyncio.Future[tuple[grpc.StatusCode, str]]] = []
    try:
        async with grpc.aio.insecure_channel(ctl.address) as ch:
            stub = BlobServiceStub(ch)
            for token in tenants:
                mine = [asyncio.ensure_future(hold(token)) for _ in range(8)]
                held += mine
                for _ in range(500):  # this tenant's 8 admitted or refused before the next one's
                    if sum(f.done() for f in held) + gate.total_uploads == len(held):
                        break
                    await asyncio.sleep(0.01)
            num_held, reserved = gate.total_uploads, gate.total_bytes
            refused = [f.result() for f in held if f.done()]
            ninth = await _put(stub, b"z" * 16, tok.a)
            release.set()
            for f in held:
                f.cancel()
            await asyncio.gather(*held, return_exceptions=True)
    finally:
        await ctl.stop(0)
    assert ninth == (Code.OK, ""), f"a ninth tenant's 16-byte put was refused: {ninth}"
    assert (num_held, reserved) == (60, 60 * 16)  # 7 x 8, then 4
    assert len(refused) == 4 and {code for code, _ in refused} == {Code.RESOURCE_EXHAUSTED}
    assert all("tenant 't7' already has 4" in d and "--upload-tenant-share=0.5" in d for _, d in refused), refused


async def test_an_uploads_clock_stops_while_the_server_waits_for_a_thread(tmp_path: Path) -> None:
    tok = make_tokens(tmp_path)
    ctl = await start_controller(store_url("sqlite", tmp_path), tok, uploads=UploadLimits(idle_s=0.5))
    try:
        async with grpc.aio.insecure_channel(ctl.address) as ch:
            stub = BlobServiceStub(ch)
            assert await _put(stub, b"control", tok.a) == (Code.OK, "")
            # every store thread busy for 2 s: the put's quota check waits for one, 4x its idle timeout
            busy = [
                asyncio.ensure_future(ctl.ctx.blocking(time.sleep, 2.0))
                for _ in range(ctl.ctx.executor._max_workers)
            ]
            await asyncio.sleep(0.1)
            t0 = time.monotonic()
            got = await _put(stub, b"d" * 1024, tok.b)
            took = time.monotonic() - t0
            await asyncio.gather(*busy)
    finally:
        await ctl.stop(0)
    print(got, f"{took:.1f}s")
    assert took > 1.0  # the server did wait for a thread (the check is not vacuous)
    assert got == (Code.OK, ""), f"the client sent everything at once, yet: {got}"


@pytest.mark.parametrize("bad", [{"tenant_share": 0.0}, {"tenant_share": 1.5}, {"min_rate": 0}])
def test_upload_limits_refuse_nonsense(bad: dict[str, float]) -> None:
    from fleet.core.errors import InvalidArgument

    with pytest.raises(InvalidArgument):
        UploadLimits(**bad)  # type: ignore[arg-type]
