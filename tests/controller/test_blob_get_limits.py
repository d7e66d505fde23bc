"""GetBlob's bounds: open streams per tenant, a client that stops reading, a tenant's share of the store
threads, and the smallest chunk a get is cut into.

Real controller, real gRPC on loopback, real SQLite store. NOTE: before these, a tenant's unread gets were
never refused and held controller memory and server RPC slots for as long as the client kept them open (100
unread 16 MiB gets: +1 GiB RSS); one tenant's GetBlob flood held all 4 store threads (another tenant's StatBlob
queued behind its chunk reads); and chunk_size=1 cost a store call and a message per byte.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
from support.controller import make_tokens, md, start_controller, store_url
from support.waits import wait_until

from controller.auth import mint_token
from controller.uploads import GetLimits, UploadLimits
from fleet.api.kvfleet.v1 import blobs_pb2
from fleet.api.kvfleet.v1.blobs_pb2_grpc import BlobServiceStub

Code = grpc.StatusCode
MIB = 1 << 20
NO_BDP = [("grpc.http2.bdp_probe", 0)]  # the client's window stays at 64 KiB: an unread stream stops the server


async def _put(stub: BlobServiceStub, data: bytes, token: str) -> str:
    async def reqs():  # type: ignore[no-untyped-def]
        ref = hashlib.sha256(data).hexdigest()
        yield blobs_pb2.PutBlobRequest(header=blobs_pb2.PutBlobHeader(size=len(data), expected_ref=ref))
        for i in range(0, len(data), MIB):
            yield blobs_pb2.PutBlobRequest(chunk=data[i:i + MIB])

    return str((await stub.PutBlob(reqs(), metadata=md(token), timeout=30)).ref)


async def _read_all(stub: BlobServiceStub, ref: str, token: str, chunk: int = 0) -> tuple[Code, str, int, int]:
    """(status, details, messages, bytes) of one GetBlob read to its end."""
    n = got = 0
    call = stub.GetBlob(blobs_pb2.GetBlobRequest(ref=ref, chunk_size=chunk), metadata=md(token), timeout=30)
    try:
        async for msg in call:
            n, got = n + 1, got + len(msg.chunk)
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details() or "", n, got
    return Code.OK, "", n, got


async def test_a_tenant_holds_at_most_its_quota_of_unread_gets(tmp_path: Path) -> None:
    tok = make_tokens(tmp_path)
    ctl = await start_controller(store_url("sqlite", tmp_path), tok)
    try:
        async with grpc.aio.insecure_channel(ctl.address, options=NO_BDP) as ch:
            stub = BlobServiceStub(ch)
            ref_a = await _put(stub, os.urandom(4 * MIB), tok.a)
            ref_b = await _put(stub, os.urandom(3 * MIB), tok.b)
            calls = [stub.GetBlob(blobs_pb2.GetBlobRequest(ref=ref_a), metadata=md(tok.a), timeout=30)
                     for _ in range(12)]  # never read
            await wait_until(lambda: sum(c.done() for c in calls) >= 4, "4 of acme's 12 unread gets refused")
            refused = [c for c in calls if c.done()]
            codes = {await c.code() for c in refused}
            details = {await c.details() for c in refused}
            # control: acme's 8 unread gets leave bravo's gets and stats alone
            bravo = await _read_all(stub, ref_b, tok.b)
            stat = await stub.StatBlob(blobs_pb2.StatBlobRequest(ref=ref_b), metadata=md(tok.b), timeout=5)
            open_a = sum(not c.done() for c in calls)
            for c in calls:
                c.cancel()
            await wait_until(lambda: ctl.ctx.gets.total_open == 0, "the cancelled gets' slots freed")
            again = await _read_all(stub, ref_a, tok.a)  # acme's quota is back once its streams ended
    finally:
        await ctl.stop(0)
    assert (len(refused), open_a) == (4, 8)
    assert codes == {Code.RESOURCE_EXHAUSTED}
    assert len(details) == 1 and "--max-gets-per-tenant=8" in details.pop()
    assert bravo == (Code.OK, "", 3, 3 * MIB)
    assert stat.meta.size == 3 * MIB
    assert again[0] is Code.OK and again[3] == 4 * MIB


async def test_eight_tenants_at_their_cap_leave_a_ninth_a_get(tmp_path: Path) -> None:
    """8 tenants each open 8 unread gets of their own 4 MiB blob (their cap), one tenant after the other: the
    eighth gets only 4, so a ninth tenant's get of its own blob is served. NOTE: before the count share, the 64
    held every slot of --max-gets and the ninth was refused."""
    tok = make_tokens(tmp_path)
    tenants = [mint_token(tok.file, f"t{i}", "tenant") for i in range(8)]
    ctl = await start_controller(store_url("sqlite", tmp_path), tok)  # the default limits: 64 in all, 8 each
    gate = ctl.ctx.gets
    try:
        async with grpc.aio.insecure_channel(ctl.address, options=NO_BDP) as ch:
            stub = BlobServiceStub(ch)
            big = os.urandom(4 * MIB)
            refs = [await _put(stub, big, t) for t in tenants]
            mine = await _put(stub, b"acme's own small blob", tok.a)
            calls: list[Any] = []

            def settled() -> bool:
                return sum(c.done() for c in calls) + gate.total_open == len(calls)

            for ref, token in zip(refs, tenants, strict=True):
                calls += [stub.GetBlob(blobs_pb2.GetBlobRequest(ref=ref), metadata=md(token), timeout=30)
                          for _ in range(8)]  # never read
                await wait_until(settled, "this tenant's 8 gets admitted or refused")
            num_open = gate.total_open
            refused = [c for c in calls if c.done()]
            codes = {await c.code() for c in refused}
            details = {await c.details() for c in refused}
            ninth = await _read_all(stub, mine, tok.a)
            for c in calls:
                c.cancel()
            await wait_until(lambda: gate.total_open == 0, "the cancelled gets' slots freed")
    finally:
        await ctl.stop(0)
    assert ninth == (Code.OK, "", 1, len(b"acme's own small blob")), ninth
    assert num_open == 60 and len(refused) == 4  # 7 x 8, then 4
    assert codes == {Code.RESOURCE_EXHAUSTED}
    assert len(details) == 1 and "tenant 't7' already has 4 open GetBlob streams" in (d := details.pop()), d


async def test_a_get_whose_client_stops_reading_ends_after_the_idle_timeout(tmp_path: Path) -> None:
    tok = make_tokens(tmp_path)
    limits = UploadLimits(gets=GetLimits(idle_s=0.3))
    ctl = await start_controller(store_url("sqlite", tmp_path), tok, uploads=limits)
    try:
        async with grpc.aio.insecure_channel(ctl.address, options=NO_BDP) as ch:
            stub = BlobServiceStub(ch)
            ref = await _put(stub, os.urandom(8 * MIB), tok.a)
            prompt = await _read_all(stub, ref, tok.a)  # control: a client that reads is never cut off
            call = stub.GetBlob(blobs_pb2.GetBlobRequest(ref=ref), metadata=md(tok.a), timeout=30)
            first = await call.read()  # then stops reading, for several idle timeouts
            await asyncio.sleep(1.5)
            got, n = len(first.chunk), 1
            code, details = Code.OK, ""
            try:
                while (msg := await call.read()) is not grpc.aio.EOF:
                    got, n = got + len(msg.chunk), n + 1
            except grpc.aio.AioRpcError as e:
                code, details = e.code(), e.details() or ""
            await wait_until(lambda: ctl.ctx.gets.total_open == 0, "the stalled get's slot freed")
    finally:
        await ctl.stop(0)
    assert prompt == (Code.OK, "", 8, 8 * MIB)
    assert code is Code.RESOURCE_EXHAUSTED and "--get-idle-timeout" in details, (code, details)
    assert got < 8 * MIB and n <= 3  # the stream read the store no further: the chunks already queued only


async def test_gets_whose_client_never_reads_again_free_their_slots_at_the_idle_timeout(tmp_path: Path) -> None:
    """8 gets with no deadline whose client takes one message each, then none. NOTE: before, each awaited its
    pending write after the idle timeout, so the 8 kept all of acme's slots and 8 MiB until the client
    cancelled, and no stall was counted."""
    tok = make_tokens(tmp_path)
    ctl = await start_controller(store_url("sqlite", tmp_path), tok, uploads=UploadLimits(gets=GetLimits(idle_s=0.3)))
    gate = ctl.ctx.gets

    def stalled() -> float:
        return ctl.ctx.metrics.registry.get_sample_value(  # type: ignore[no-any-return]
            "kvfleet_cas_ops_total", {"op": "get", "outcome": "stalled"}) or 0.0

    try:
        async with grpc.aio.insecure_channel(ctl.address, options=NO_BDP) as ch:
            stub = BlobServiceStub(ch)
            ref = await _put(stub, os.urandom(8 * MIB), tok.a)
            calls = [stub.GetBlob(blobs_pb2.GetBlobRequest(ref=ref), metadata=md(tok.a)) for _ in range(8)]
            for c in calls:
                await c.read()  # one message each, then never again
            await wait_until(lambda: gate.total_open == 0, "the 8 unread gets' slots freed")
            held = (gate.total_bytes, dict(gate.unread), stalled())
            ninth = await _read_all(stub, ref, tok.a)  # while its client keeps the 8 open
            code, details = Code.OK, ""
            try:  # one client reads again: the message gRPC kept, then the status
                while await calls[0].read() is not grpc.aio.EOF:
                    pass
            except grpc.aio.AioRpcError as e:
                code, details = e.code(), e.details() or ""
            await wait_until(lambda: gate.unread["acme"] == 7, "the read call's status taken")
            tenth = await _read_all(stub, ref, tok.a)
            for c in calls[1:]:
                c.cancel()
            await wait_until(lambda: not gate.unread, "the cancelled calls' count dropped")
    finally:
        await ctl.stop(0)
    assert held == (0, {"acme": 8}, 8.0), held
    assert ninth[0] is Code.RESOURCE_EXHAUSTED and "neither read their status nor cancelled" in ninth[1], ninth
    assert code is Code.RESOURCE_EXHAUSTED and "--get-idle-timeout" in details, (code, details)
    assert tenth == (Code.OK, "", 8, 8 * MIB)


async def test_gets_whose_client_never_reads_a_message_are_counted_and_get_their_status(tmp_path: Path) -> None:
    """8 gets whose client reads nothing at all. NOTE: their first write carried the response headers; when it
    stalled, the stall's status asked gRPC to send the headers again, which it refused: no status went out, the
    calls stayed open outside the gate's counts, and a tenant could hold every server RPC slot this way."""
    tok = make_tokens(tmp_path)
    ctl = await start_controller(store_url("sqlite", tmp_path), tok, uploads=UploadLimits(gets=GetLimits(idle_s=0.3)))
    gate = ctl.ctx.gets
    try:
        async with grpc.aio.insecure_channel(ctl.address, options=NO_BDP) as ch:
            stub = BlobServiceStub(ch)
            ref = await _put(stub, os.urandom(4 * MIB), tok.a)
            calls = [stub.GetBlob(blobs_pb2.GetBlobRequest(ref=ref), metadata=md(tok.a)) for _ in range(8)]
            await wait_until(lambda: gate.unread["acme"] == 8, "the 8 never-read gets counted unread")
            ninth = await _read_all(stub, ref, tok.a)
            code = Code.OK
            try:  # the client reads at last: what gRPC kept, then the status
                while await calls[0].read() is not grpc.aio.EOF:
                    pass
            except grpc.aio.AioRpcError as e:
                code = e.code()
            for c in calls[1:]:
                c.cancel()
            await wait_until(lambda: not gate.unread, "the calls' count dropped")
    finally:
        await ctl.stop(0)
    assert ninth[0] is Code.RESOURCE_EXHAUSTED and "neither read their status nor cancelled" in ninth[1], ninth
    assert code is Code.RESOURCE_EXHAUSTED  # before: no status, the call hung


class _CountingStore:
    """The real store; counts the store calls running at once per tenant (each made to take 10 ms)."""

    def __init__(self, store: Any) -> None:
        self._store, self._lock = store, threading.Lock()
        self.running: Counter[str] = Counter()
        self.peak: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    @contextlib.contextmanager
    def _call(self, tenant: str) -> Iterator[None]:
        with self._lock:
            self.running[tenant] += 1
            self.peak[tenant] = max(self.peak[tenant], self.running[tenant])
        try:
            time.sleep(0.01)
            yield
        finally:
            with self._lock:
                self.running[tenant] -= 1

    def stat(self, ref: str, tenant: str) -> Any:
        with self._call(tenant):
            return self._store.stat(ref, tenant)

    def sized_stream(self, ref: str, tenant: str, chunk_size: int) -> tuple[int, Iterator[bytes]]:
        with self._call(tenant):
            size, it = self._store.sized_stream(ref, tenant, chunk_size)

        def chunks() -> Iterator[bytes]:
            while True:
                with self._call(tenant):
                    chunk = next(it, None)
                if chunk is None:
                    return
                yield chunk

        return size, chunks()


async def test_one_tenants_get_flood_holds_at_most_three_quarters_of_the_store_threads(tmp_path: Path) -> None:
    tok = make_tokens(tmp_path)
    ctl = await start_controller(store_url("sqlite", tmp_path), tok, store_threads=4)
    try:
        async with grpc.aio.insecure_channel(ctl.address) as ch:
            stub = BlobServiceStub(ch)
            ref_a = await _put(stub, os.urandom(2 * MIB), tok.a)
            ref_b = await _put(stub, b"bravo's blob", tok.b)
            spy = ctl.ctx.store = _CountingStore(ctl.ctx.store)
            flood = [_read_all(stub, ref_a, tok.a, chunk=64 << 10) for _ in range(8)]
            stats = [stub.StatBlob(blobs_pb2.StatBlobRequest(ref=ref_b), metadata=md(tok.b), timeout=10)
                     for _ in range(20)]
            ends = await asyncio.gather(*flood, *stats)
    finally:
        await ctl.stop(0)
    assert all(e[0] is Code.OK and e[3] == 2 * MIB for e in ends[:8])
    assert all(s.meta.size == len(b"bravo's blob") for s in ends[8:])  # control: bravo's calls all answered
    assert spy.peak["acme"] == 3, spy.peak  # three quarters of the 4 threads; before: all 4
    assert spy.peak["bravo"] >= 1


class _CountingExecutor(ThreadPoolExecutor):
    def __init__(self, n: int) -> None:
        super().__init__(n, thread_name_prefix="kvfleet-store")
        self.tasks = 0

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Future[Any]:
        self.tasks += 1
        return super().submit(fn, *args, **kwargs)


async def test_tiny_chunks_are_rounded_up_and_read_in_batches(tmp_path: Path) -> None:
    tok = make_tokens(tmp_path)
    ctl = await start_controller(store_url("sqlite", tmp_path), tok)
    try:
        async with grpc.aio.insecure_channel(ctl.address) as ch:
            stub = BlobServiceStub(ch)
            small = await _put(stub, os.urandom(2048), tok.a)
            big = await _put(stub, os.urandom(MIB), tok.a)
            ex = ctl.ctx.executor = _CountingExecutor(4)
            one_byte = await _read_all(stub, small, tok.a, chunk=1)
            before = ex.tasks
            batched = await _read_all(stub, big, tok.a, chunk=64 << 10)
            tasks = ex.tasks - before
            default = await _read_all(stub, big, tok.a)  # control: the default chunk is unchanged
    finally:
        await ctl.stop(0)
    assert one_byte == (Code.OK, "", 1, 2048)  # before: 2,048 messages and store reads of one byte
    assert batched == (Code.OK, "", 16, MIB)
    assert tasks <= 4, tasks  # the size and iterator, one batch of 16 chunks, its end; before: 17
    assert default == (Code.OK, "", 1, MIB)
