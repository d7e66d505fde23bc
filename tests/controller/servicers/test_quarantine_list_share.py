"""ListQuarantines runs on the store's threads within the caller's share of them (ServiceContext.tenant_blocking),
as blob calls do: one tenant's flood of listings leaves another tenant's StatBlob a thread. Real controller, real
gRPC on loopback, real SQLite store; the listing's store scan is held on a gate (a real store behind it), so the
order is the test's, whatever the machine's speed. NOTE: before, ListQuarantines took any store thread
(ServiceContext.blocking): acme's listings held all 4 and bravo's StatBlob waited until they ended."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import grpc
from support.controller import make_tokens, md, start_controller, store_url

from fleet.api.kvfleet.v1 import blobs_pb2
from fleet.api.kvfleet.v1 import quarantine_pb2 as pb
from fleet.api.kvfleet.v1.blobs_pb2_grpc import BlobServiceStub
from fleet.api.kvfleet.v1.quarantine_pb2_grpc import QuarantineServiceStub


class _HeldScans:
    """The real store; its kv_scan (the listing's read of every record) waits for `gate`, counting the scans in."""

    def __init__(self, store: Any) -> None:
        self._store, self.gate, self.entered = store, threading.Event(), 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def kv_scan(self, *args: Any) -> Any:
        self.entered += 1  # NOTE: += under the GIL from the store threads; read only to wait for >= 3
        self.gate.wait(60)
        return self._store.kv_scan(*args)


async def _put(stub: BlobServiceStub, data: bytes, token: str) -> str:
    async def it():  # type: ignore[no-untyped-def]
        yield blobs_pb2.PutBlobRequest(header=blobs_pb2.PutBlobHeader(size=len(data)))
        yield blobs_pb2.PutBlobRequest(chunk=data)

    return (await stub.PutBlob(it(), metadata=md(token))).ref  # type: ignore[no-any-return]


async def test_one_tenants_listings_leave_another_tenant_a_store_thread(tmp_path: Path) -> None:
    t = make_tokens(tmp_path)
    ctl = await start_controller(store_url("sqlite", tmp_path), t, store_threads=4, detector_layers=("rules",))
    try:
        async with grpc.aio.insecure_channel(ctl.address) as ch:
            q, blobs = QuarantineServiceStub(ch), BlobServiceStub(ch)
            ref = await _put(blobs, b"bravo's blob", t.b)
            judge = await ctl.ctx.judge()
            held = judge.store = _HeldScans(judge.store)
            listings = [asyncio.ensure_future(q.ListQuarantines(pb.ListQuarantinesRequest(), metadata=md(t.a)))
                        for _ in range(8)]
            while held.entered < 3:
                await asyncio.sleep(0.01)
            try:  # acme's listings are held in the store; bravo's call is answered meanwhile
                meta = (await blobs.StatBlob(blobs_pb2.StatBlobRequest(ref=ref), metadata=md(t.b), timeout=30)).meta
                assert meta.size == len(b"bravo's blob") and not any(x.done() for x in listings)
                assert held.entered == 3  # three quarters of the 4 store threads; before: 4
            finally:
                held.gate.set()
            assert [len(r.records) for r in await asyncio.gather(*listings)] == [0] * 8  # control: all answered
    finally:
        await ctl.stop(0)
