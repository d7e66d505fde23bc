"""BlobService: chunked put/get and stat over fleet.cas, tenant taken from the token.

Memory: a put holds the received chunks in one buffer, which the store hashes and writes as it is (one copy of
the blob: what the upload gate reserved); a get streams the store's chunks as they come.
Unfinished puts are bounded by controller/uploads.py: a put counts per tenant and in total from its start,
reserves its announced size when its header arrives, and one that sends no bytes for the idle timeout is dropped.
Stored bytes are bounded per tenant (--max-blob-bytes-per-tenant): the store checks the quota in the
same transaction as the write; a header with an expected_ref (not yet stored) that cannot fit is
refused before any chunk is buffered. A stored blob is queued for the heavy detector layers in the tenant's
judge lane (ServiceContext.judge_blob_later; docs/quarantine_path.md): the put never waits for it.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Generator, Iterator
from typing import Any

import grpc

from controller.auth import Identity, Role
from controller.servicers.common import ServiceContext, fail_call, unary
from controller.uploads import GetRefused, GetStalled, UploadRefused, UploadStalled, progressing, written
from fleet.api.kvfleet.v1 import blobs_pb2 as pb
from fleet.api.kvfleet.v1 import blobs_pb2_grpc as pbg
from fleet.cas.quota import OverQuota, over_quota
from fleet.cas.types import blob_charge, check_ref
from fleet.core.errors import InvalidArgument, NotFound, ResourceExhausted

log = logging.getLogger("kvfleet.controller")

DEFAULT_CHUNK = 1 << 20
MAX_CHUNK = 2 << 20
MIN_CHUNK = 64 << 10  # a smaller requested chunk_size is rounded up to it
READ_BATCH = 1 << 20  # a get reads at least this many bytes of chunks per store task (one chunk if larger)


def _read_batch(it: Iterator[bytes], batch: int) -> list[bytes]:
    """The iterator's next chunks, `batch` bytes or more (fewer at the end; none once it ended)."""
    out, n = [], 0
    for chunk in it:
        out.append(chunk)
        n += len(chunk)
        if n >= batch:
            break
    return out


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


class BlobServicer(pbg.BlobServiceServicer):
    def __init__(self, ctx: ServiceContext) -> None:
        self.ctx = ctx

    @unary(Role.TENANT)
    async def PutBlob(self, request_iterator: AsyncIterator[pb.PutBlobRequest], context: grpc.aio.ServicerContext,
                      ident: Identity) -> pb.PutBlobResponse:
        gate = self.ctx.uploads
        # the upload's clock runs only while waiting on the client (controller/uploads.py)
        requests = aiter(progressing(request_iterator, idle_s=gate.limits.idle_s, min_rate=gate.limits.min_rate))
        try:
            # NOTE: counted from the call's start, not from its header: a put waiting for its header held a server
            # RPC slot outside the gate, so one tenant's header-less puts took all of --grpc-max-concurrent-rpcs
            # and every other tenant's calls were refused
            with gate.admit(ident.tenant, 0) as held:  # held until the store has the bytes (or refused them)
                header = await self._header(requests)
                await self._check_stored(ident.tenant, header)
                held.grow(header.size)
                ref = await self._store(requests, header, ident.tenant)
        except UploadStalled:  # counted here: a client still writing may read gRPC's own error, not ours
            self.ctx.metrics.cas_ops.labels(op="put", outcome="stalled").inc()
            raise
        except UploadRefused:
            self.ctx.metrics.cas_ops.labels(op="put", outcome="upload_budget").inc()
            raise
        self.ctx.metrics.cas_ops.labels(op="put", outcome="ok").inc()
        self.ctx.metrics.cas_bytes.labels(direction="in").inc(header.size)
        self.ctx.judge_blob_later(ident.tenant, ref)  # a heavy layer's verdict, in the tenant's lane, not waited for
        return pb.PutBlobResponse(ref=ref, size=header.size)

    async def _store(self, requests: AsyncIterator[pb.PutBlobRequest], header: pb.PutBlobHeader, tenant: str) -> str:
        # NOTE: the buffer went to store.put_stream as a one-chunk stream, which gathered it into a second buffer:
        # a put peaked at two copies of its blob while the upload gate reserved one. store.put hashes and writes
        # the buffer itself.
        (buf,) = await self._chunks(requests, header)
        put = functools.partial(self.ctx.store.put, quota=self.ctx.blob_bytes_per_tenant)
        try:
            ref: str = await self.ctx.tenant_blocking(tenant, put, buf, tenant, header.expected_ref or None)
        except OverQuota:
            self.ctx.metrics.cas_ops.labels(op="put", outcome="over_quota").inc()
            raise
        return ref

    async def _header(self, requests: AsyncIterator[pb.PutBlobRequest]) -> pb.PutBlobHeader:
        """Read the header; refuse early (before buffering anything) on a size problem."""
        first = await anext(requests, None)
        if first is None or first.WhichOneof("kind") != "header":
            raise InvalidArgument("PutBlob's first message must be a header {size, expected_ref}; chunks follow it")
        header, limit = first.header, self.ctx.max_blob_bytes
        if header.expected_ref:  # NOTE: was checked by the store, once every byte had arrived (up to 64 MiB)
            check_ref(header.expected_ref)
        if header.size > limit:
            self.ctx.metrics.cas_ops.labels(op="put", outcome="too_large").inc()
            raise ResourceExhausted(f"blob of {header.size} bytes ({_mib(header.size)}) exceeds the store limit of "
                                    f"{limit} bytes ({_mib(limit)}); split it or raise the controller's --max-blob-bytes")
        return header

    async def _check_stored(self, tenant: str, header: pb.PutBlobHeader) -> None:
        """Refuse a put that cannot fit the tenant's stored-bytes quota before its bytes arrive.

        Advisory (the store's own check, atomic with the write, decides). A blob the tenant already
        stores costs nothing, so only a header naming its expected_ref (the SDK sends it by default)
        can be judged here: one without it may be a re-put, and is judged once its bytes are in.
        """
        quota = self.ctx.blob_bytes_per_tenant
        if not quota or not header.expected_ref:
            return
        used: int = await self.ctx.tenant_blocking(tenant, self.ctx.store.stored_bytes, tenant)
        if used + blob_charge(header.size) <= quota:
            return
        if await self.ctx.tenant_blocking(tenant, self.ctx.store.exists, header.expected_ref, tenant):
            return
        self.ctx.metrics.cas_ops.labels(op="put", outcome="over_quota").inc()
        raise over_quota(tenant, used, header.size, quota)

    @staticmethod
    async def _chunks(requests: AsyncIterator[pb.PutBlobRequest], header: pb.PutBlobHeader) -> list[bytearray]:
        """Read the chunks after the header into one buffer: exactly header.size bytes, or nothing is stored.

        NOTE: the chunks were kept as a list of the messages' bytes objects: about 50 bytes each besides the
        payload, so a client sending tiny chunks made the controller hold many times the size the upload gate
        reserved (a 4 MiB put in 8-byte chunks: +42 MiB of controller RSS against +21 MiB in 1 MiB chunks).
        """
        buf = bytearray()
        async for msg in requests:
            if msg.WhichOneof("kind") != "chunk":
                raise InvalidArgument("PutBlob got a second header; send exactly one header, then chunks")
            if len(buf) + len(msg.chunk) > header.size:
                raise InvalidArgument(f"PutBlob received more bytes than the header's size={header.size}; "
                                      "send the exact blob size in the header")
            buf += msg.chunk
        if len(buf) != header.size:
            raise InvalidArgument(f"PutBlob stream ended after {len(buf)} of the {header.size} bytes its header "
                                  "announced; nothing was stored")
        return [buf]

    @unary(Role.TENANT)  # a server stream written with context.write: each write is waited for on the client's clock
    async def GetBlob(self, request: pb.GetBlobRequest, context: grpc.aio.ServicerContext,
                      ident: Identity) -> None:
        size = request.chunk_size or DEFAULT_CHUNK
        if size > MAX_CHUNK:
            raise InvalidArgument(f"chunk_size {size} is over the maximum of {MAX_CHUNK} bytes (2 MiB)")
        size = max(size, MIN_CHUNK)  # smaller chunks cost a store read and a message each for a few bytes
        tenant, gate = ident.tenant, self.ctx.gets
        batch = max(READ_BATCH, size)
        blob_size, it = await self.ctx.tenant_blocking(tenant, self.ctx.store.sized_stream, request.ref, tenant, size)
        stalled: GetStalled | None = None
        try:
            with gate.admit(tenant, min(blob_size, batch)):  # held until the stream ends or stalls
                sent = await self._send(context, it, tenant, batch)
        except GetRefused:
            self.ctx.metrics.cas_ops.labels(op="get", outcome="get_budget").inc()
            raise
        except GetStalled as e:  # its status is sent once the store iterator is closed
            stalled = e
        finally:
            it.close()
        if stalled is not None:
            self.ctx.metrics.cas_ops.labels(op="get", outcome="stalled").inc()
            await self._end_stalled(context, tenant, stalled)
            return
        self.ctx.metrics.cas_ops.labels(op="get", outcome="ok").inc()
        self.ctx.metrics.cas_bytes.labels(direction="out").inc(sent)

    async def _end_stalled(self, context: grpc.aio.ServicerContext, tenant: str, stalled: GetStalled) -> None:
        """Send a stalled get's status, counted in the gate's `unread` until its client takes it (after the
        message gRPC kept) or cancels; a cancel is the call's end, not a failure."""
        with self.ctx.gets.stalled(tenant):
            try:
                await fail_call(self.ctx, context, "GetBlob", stalled)
            except grpc.aio.InternalError:
                if not context.cancelled():  # anything but the client's cancel is ours: say so
                    log.exception("GetBlob: the stalled get's status could not be sent")

    async def _send(self, context: grpc.aio.ServicerContext, it: Generator[bytes, None, None], tenant: str,
                    batch: int) -> int:
        """Write the blob's chunks as the store reads them, a batch of chunks per store task; each write is
        waited for on the client's clock (controller/uploads.py: written)."""
        idle_s, sent = self.ctx.gets.limits.idle_s, 0
        # NOTE: sent with the first write, the headers went unrecorded when that write stalled, and the stall's
        # status then asked gRPC to send them again: refused (TOO_MANY_OPERATIONS), no status ever went out, and
        # the call stayed open outside the gate's counts (a tenant's never-read gets took every server RPC slot)
        await context.send_initial_metadata(())
        chunks = await self.ctx.tenant_blocking(tenant, _read_batch, it, batch)
        chunks.reverse()
        while chunks:
            msg = pb.GetBlobResponse(chunk=chunks.pop())
            if not await written(context.write(msg), idle_s):  # the stream reads no more, and frees its slot
                raise GetStalled(f"GetBlob's client took no message for {idle_s:g} s (limit --get-idle-timeout; "
                                 f"{sent} bytes sent before); read the stream as it comes")
            sent += len(msg.chunk)
            if not chunks:
                chunks = await self.ctx.tenant_blocking(tenant, _read_batch, it, batch)
                chunks.reverse()
        return sent

    @unary(Role.TENANT)
    async def StatBlob(self, request: pb.StatBlobRequest, context: grpc.aio.ServicerContext,
                       ident: Identity) -> pb.StatBlobResponse:
        meta = await self.ctx.tenant_blocking(ident.tenant, self.ctx.store.stat, request.ref, ident.tenant)
        return pb.StatBlobResponse(meta=meta_to_proto(meta))

    # -- operations: pins and GC -----------------------------------------------------------------

    @unary(Role.TENANT)
    async def PinBlob(self, request: pb.PinBlobRequest, context: grpc.aio.ServicerContext,
                      ident: Identity) -> pb.PinBlobResponse:
        return await self._pin(request, ident, self.ctx.store.pin)

    @unary(Role.TENANT)
    async def UnpinBlob(self, request: pb.PinBlobRequest, context: grpc.aio.ServicerContext,
                        ident: Identity) -> pb.PinBlobResponse:
        return await self._pin(request, ident, self.ctx.store.unpin)

    async def _pin(self, request: pb.PinBlobRequest, ident: Identity, verb: Any) -> pb.PinBlobResponse:
        """The answer is the metadata the pin or unpin itself read (one store transaction/script). NOTE: a stat()
        after the unpin found the blob gone when GC collected it in between (unpinned, no reference, lease run
        out), and the client read NOT_FOUND for an unpin that had happened."""
        tenant = _pin_tenant(request, ident)
        meta = await self.ctx.tenant_blocking(ident.tenant, verb, request.ref, tenant)
        return pb.PinBlobResponse(meta=meta_to_proto(meta))

    @unary(Role.OPERATOR)
    async def CollectGarbage(self, request: pb.CollectGarbageRequest, context: grpc.aio.ServicerContext,
                             ident: Identity) -> pb.CollectGarbageResponse:
        return pb.CollectGarbageResponse(num_collected=await self.ctx.store_gc.run_once())


def _pin_tenant(request: pb.PinBlobRequest, ident: Identity) -> str:
    """The tenant whose blob a pin names: an operator may name any; a tenant only its own, and
    another tenant's blob answers exactly like a missing one (NOT_FOUND)."""
    if not request.tenant or request.tenant == ident.tenant:
        return ident.tenant
    if ident.role is Role.OPERATOR:
        return request.tenant
    raise NotFound(f"blob {request.ref} not found for tenant {ident.tenant!r}")


def meta_to_proto(m: Any) -> pb.BlobMeta:
    return pb.BlobMeta(ref=m.ref, size=m.size, created=float(m.created or 0), pins=int(m.pins or 0),
                       refs=int(m.refs or 0), verdict=str(m.verdict or ""), reasons=list(m.reasons or ()),
                       lease_expires=float(m.lease_expires or 0))
