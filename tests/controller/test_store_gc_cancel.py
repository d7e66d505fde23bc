"""A CollectGarbage whose client gives up does not let another collection start beside the one still running.

Real controller, real gRPC on loopback, the real store's GC; the test only holds that GC's thread until it lets
it go (a collection of a large backlog: 1,000,000 expired blobs take 51 s on SQLite, docs/store.md). NOTE:
before the fix, the cancelled call let go of StoreGc's lock while its thread went on collecting: the next
CollectGarbage (an operator's retry after a client deadline) started a second collection beside it, each on one
of the controller's 4 store threads that every tenant's blob calls share; two cut-off retries held three of them.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import grpc
import pytest
from support.controller import make_tokens, md, start_controller, store_url

from fleet.api.kvfleet.v1 import blobs_pb2
from fleet.api.kvfleet.v1.blobs_pb2_grpc import BlobServiceStub


async def test_cut_off_collect_garbage_calls_never_run_two_collections(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    tok = make_tokens(tmp_path)
    ctl = await start_controller(store_url("sqlite", tmp_path), tok, gc_interval_s=0)
    store, release, lock = ctl.ctx.store, threading.Event(), threading.Lock()
    running, most, runs, real_gc = [0], [0], [0], store.gc

    def held_gc(*args: Any) -> int:  # the real collection, after the test lets its thread go
        with lock:
            running[0] += 1
            runs[0] += 1
            most[0] = max(most[0], running[0])
        try:
            release.wait(20)
            return int(real_gc(*args))
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(store, "gc", held_gc)
    try:
        async with grpc.aio.insecure_channel(ctl.address) as ch:
            stub = BlobServiceStub(ch)
            codes = []
            for _ in range(3):  # an operator's call and two retries, each cut off by its deadline
                try:
                    await stub.CollectGarbage(blobs_pb2.CollectGarbageRequest(), metadata=md(tok.op), timeout=0.5)
                    codes.append(grpc.StatusCode.OK)
                except grpc.aio.AioRpcError as e:
                    codes.append(e.code())
            during = most[0]
            # NOTE: each client saw its deadline pass, but the server learns of it on its own, later on a loaded
            # machine; released before, the collection let go of the lock while a retry's run still waited for it,
            # and that run collected once more (runs 3: a fresh-clone CI run). So wait for the server's side.
            gc = ctl.ctx.store_gc
            for _ in range(1000):
                if len(gc._runs) == 1:
                    break
                await asyncio.sleep(0.01)
            queued = len(gc._runs) - 1  # besides the collection held: the cut-off retries' runs the server still has
            release.set()
            done = await stub.CollectGarbage(blobs_pb2.CollectGarbageRequest(), metadata=md(tok.op), timeout=20)
    finally:
        release.set()
        await ctl.stop()
    assert during == 1, f"{during} collections ran at once"
    assert queued == 0, f"{queued} cut-off calls' runs stayed queued behind the collection"
    assert codes == [grpc.StatusCode.DEADLINE_EXCEEDED] * 3, codes
    assert done.num_collected == 0 and running[0] == 0  # control: once let go, a collection runs and ends
    assert runs[0] == 2, runs  # the first cut-off call's and the last call's: the retries queued no collection
