"""What every servicer shares: the service context, auth, and error -> status mapping.

Servicers are thin: authenticate, translate proto -> domain, call the core, translate back. Every
failure leaves as a gRPC status with a message a person can act on; nothing crashes the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc

from controller.auth import Authenticator, Identity, Role
from controller.edge import (
    DEFAULT_MAX_ROUTE_TOKENS,
    GrpcLimits,
    Undecodable,
    checked_stream,
    refuse,
)
from controller.judge_lanes import JudgeLanes
from controller.keyed_slots import KeyedSlots
from controller.metrics import Metrics
from controller.quotas import SessionLimits
from controller.uploads import GetGate, UploadGate, UploadLimits
from controller.verdicts import Judge
from fleet.core.errors import ANSWERED_TRAILER, KvfleetError, ResourceExhausted, Unavailable
from fleet.core.quarantine.detector_config import DetectorConfig
from fleet.sdk.quarantine import Judgement
from workers.placement import NODE_KV_BYTES, NODE_MAX_SESSIONS

log = logging.getLogger("kvfleet.controller")
T = TypeVar("T")


class RpcShares:
    """The server's open RPCs (`--grpc-max-concurrent-rpcs`), at most three quarters of them per tenant: past that a
    tenant's next call is refused at once, so the other tenants keep a quarter of the server (one tenant never slows
    another). NOTE: before, only some calls had a per-tenant bound of their own (uploads, gets, session calls), and a
    tenant's calls that wait held a server slot each while they waited: 1,000 JudgeToolResults in its judge lane
    (which queues up to 1,024 jobs) or 1,000 RouteStreams left open took every slot, and gRPC refused every other
    tenant's calls ("Concurrent RPC limit exceeded"; tests/controller/test_rpc_shares.py)."""

    def __init__(self, total: int, one_tenant: bool = False) -> None:
        """`one_tenant`: auth is off, every caller is one identity, which then may hold every slot."""
        self.total = total
        self.per_tenant = total if one_tenant else max(1, total - total // 4)
        self.held: dict[str, int] = {}

    @contextlib.contextmanager
    def hold(self, tenant: str) -> Any:
        n = self.held.get(tenant, 0)
        if n >= self.per_tenant:
            raise ResourceExhausted(
                f"tenant {tenant!r} already has {n} calls open on this controller (at most {self.per_tenant}, three "
                f"quarters of --grpc-max-concurrent-rpcs {self.total}); retry when some have finished")
        self.held[tenant] = n + 1
        try:
            yield
        finally:
            if self.held[tenant] > 1:
                self.held[tenant] -= 1
            else:
                del self.held[tenant]


@dataclass(slots=True)
class ServiceContext:
    """Dependencies of the servicers. `leader` gates every kvfleet RPC (standby -> UNAVAILABLE)."""

    auth: Authenticator
    metrics: Metrics
    store: Any  # fleet.cas.BlobStore
    router: Any  # controller.router.Router, or None before it started
    max_blob_bytes: int
    store_url: str = ""
    ray_address: str | None = None  # the Ray cluster the kernel hosts run on (None: local / RAY_ADDRESS)
    store_gc: Any = None  # controller.store_gc.StoreGc (the CollectGarbage RPC and the leader's schedule)
    kernel_fleet: Any = None  # workers.fleet.KernelFleet, once the first session call built it
    kernel_spec: dict[str, Any] | None = None  # the one this controller wrote (--kernel-*) or built its fleet with
    fleet_metrics: Any = None  # controller.fleet_metrics.FleetMetricsPoller
    on_stop: list[Callable[[], None]] = field(default_factory=list)  # run by Controller.stop
    executor: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(4, thread_name_prefix="kvfleet-store"))
    leader: bool = True
    uploads: UploadGate = field(default_factory=lambda: UploadGate(UploadLimits()))
    max_route_tokens: int = DEFAULT_MAX_ROUTE_TOKENS  # a Route longer than this is refused (--max-route-tokens)
    blob_bytes_per_tenant: int = 0  # blob bytes a tenant may have stored, 0: no quota (--max-blob-bytes-per-tenant)
    verdicts_per_tenant: int = 0  # cached verdicts and records a tenant keeps, 0: no bound (--max-verdicts-per-tenant)
    session_limits: SessionLimits = field(default_factory=SessionLimits)  # per-tenant quotas, lanes, idle TTL
    node_kv_bytes: int = NODE_KV_BYTES  # KV budget of one Ray node of the session fleet (--node-kv-bytes)
    node_max_sessions: int = NODE_MAX_SESSIONS  # sessions one node's kernel host holds (--node-max-sessions)
    detector: DetectorConfig = field(default_factory=DetectorConfig)  # the Judge's policy (--detector-layers)
    detector_tenants: dict[str, DetectorConfig] = field(default_factory=dict)  # --detector-tenant overrides
    judge_lanes: JudgeLanes = field(default_factory=JudgeLanes)  # the detector's own pool, per-tenant lanes
    rpc_shares: RpcShares = field(default_factory=lambda: RpcShares(GrpcLimits().max_concurrent_rpcs))
    gets: GetGate = field(init=False)  # open GetBlob streams per tenant (uploads.limits.gets)
    store_lanes: KeyedSlots = field(init=False)  # a tenant's blob calls hold at most 3/4 of the store threads
    _judge: Judge | None = None
    _judge_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _heavy_pending: set[tuple[str, str]] = field(default_factory=set)  # (tenant, ref) queued for `heavy`

    def __post_init__(self) -> None:
        self.gets = GetGate(self.uploads.limits.gets)
        # NOTE: with no total, each tenant had its three quarters whatever the others held: two tenants flooding
        # submitted 6 calls to the 4 threads, and a third tenant's call queued behind theirs (first come, first
        # served) instead of taking the next thread that freed (tests/controller/test_store_threads_share.py)
        self.store_lanes = KeyedSlots(store_share(self.executor), self.executor._max_workers, key_name="tenant",
                                      name="store threads")

    async def judge(self) -> Judge:
        """The controller's one Judge (proxy verdicts and session admissions), built on first use: calls that
        arrive while it loads wait for that one (loading the encoder takes seconds). Built on a judge
        thread, not the store executor; torch's intra-op threads are pinned to one (see pin_torch_threads)."""
        async with self._judge_lock:
            if self._judge is None:
                loop = asyncio.get_running_loop()
                build = functools.partial(Judge, self.store, self.detector, self.detector_tenants,
                                          self.verdicts_per_tenant or None, self._not_stored)
                self._judge = await loop.run_in_executor(self.judge_lanes.pool, build)
                pin_torch_threads()
        return self._judge

    def _not_stored(self, kind: str, reason: str) -> None:
        self.metrics.quarantine_not_stored.labels(kind, reason).inc()

    async def judge_now(self, tenant: str, results: list[bytes], action: str) -> list[Judgement]:
        """JudgeToolResults' verdicts: each distinct result judged in `tenant`'s lane (fast layers; a heavy
        layer's verdict is waited for only when already stored), the heavy layers queued in the background,
        quarantines recorded for the tenant."""
        j = await self.judge()
        j.check(len(results), action)
        distinct = list(dict.fromkeys(results))
        got = await self.judge_lanes.run_many(tenant, j.now, [(data, tenant) for data in distinct])
        verdicts = {}
        for data, (jm, later) in zip(distinct, got, strict=True):
            verdicts[data] = jm
            if later:
                self.judge_later(j, tenant, jm.ref, data)
        out = [verdicts[data] for data in results]
        if any(x.quarantined for x in out):
            await self.judge_lanes.run(tenant, j.record, tenant, out, action)
        return out

    async def admission(self, ref: str, tenant: str) -> Judgement:
        """AdmitToolResult's verdict on the tenant's blob `ref`, in the tenant's lane (as judge_now)."""
        j = await self.judge()
        jm, later = await self.judge_lanes.run(tenant, j.admission, ref, tenant, True)
        if later:  # NOTE: queued by ref, read when it runs: it held the blob's bytes (up to 64 MiB) while it waited
            self.judge_later(j, tenant, jm.ref, None)
        return jm

    def judge_blob_later(self, tenant: str, ref: str) -> None:
        """PutBlob's hook: the tenant's new blob gets its full verdict in the background when the tenant's
        config has a heavy layer, so a later AdmitToolResult (or the proxy) finds it stored. Nothing when the
        Judge is not built yet: a controller that never judged loads no detector for an upload."""
        j = self._judge
        if j is not None and j.fast_for(tenant) is not None:
            self.judge_later(j, tenant, ref, None)

    def judge_later(self, j: Judge, tenant: str, ref: str, data: bytes | None) -> None:
        """Queue the full verdict (heavy layers) on `data` (None: the tenant's blob `ref`, read when the job
        runs) in `tenant`'s lane, once while it is pending."""
        key = (tenant, ref)
        if key in self._heavy_pending:
            return

        def heavy() -> None:
            try:
                j.heavy(data, tenant) if data is not None else j.heavy_blob(ref, tenant)
            finally:
                self._heavy_pending.discard(key)  # NOTE: set.discard is atomic under the GIL

        self._heavy_pending.add(key)
        if not self.judge_lanes.background(tenant, heavy, nbytes=0 if data is None else len(data)):
            self._heavy_pending.discard(key)  # the tenant's background queue is full: judged when next seen

    async def blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a blocking store call off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, functools.partial(fn, *args))

    async def tenant_blocking(self, tenant: str, fn: Callable[..., T], *args: Any) -> T:
        """`blocking` for one tenant's blob call: it waits for one of the tenant's store_share(executor) slots
        first, so one tenant's flood (64 GetBlob streams) never holds every store thread and another tenant's
        StatBlob or PutBlob finds one free (else it queued behind the flood's reads, FIFO). Tenants calling at
        once split those three quarters evenly (controller/keyed_slots.py), and a freed thread goes to the
        waiting tenant holding the fewest, so a tenant arriving beside two floods runs next."""
        async with self.store_lanes.hold(tenant, None, "store call"):
            fut = asyncio.get_running_loop().run_in_executor(self.executor, functools.partial(fn, *args))
            try:
                return await asyncio.shield(fut)
            except asyncio.CancelledError:  # the slot is held until the thread is free again (a caller that
                while not fut.done():  # cancels must not start its next store call beside this one)
                    with contextlib.suppress(asyncio.CancelledError):
                        await asyncio.wait((fut,))
                raise

    def need_router(self) -> Any:
        if self.router is None:
            raise Unavailable("the router is not running on this controller yet; retry shortly")
        return self.router


def store_share(executor: ThreadPoolExecutor) -> int:
    """Store threads one tenant's blob calls may hold at once: three quarters of them (at least one), so others
    keep at least a quarter. NOTE: half cost one tenant's puts 20% of their throughput (8 concurrent 256 KiB puts
    on Redis: 73-83 MiB/s against 98-102 before); at three quarters they were level (101-106 against 96-109)."""
    return max(1, executor._max_workers - executor._max_workers // 4)


def pin_torch_threads() -> None:
    """One intra-op thread for torch in this process (if the encoder loaded it): a judge job then runs on
    its judge thread alone, so time.thread_time() is its whole CPU and `--judge-threads` bounds the cores
    judging takes (torch's default, one thread per core, let one inspection take every core). The
    controller runs no other torch work (sessions run in their own processes)."""
    import sys  # noqa: PLC0415

    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)


MAX_MESSAGE_CHARS = 1000  # an error message longer than this is cut: never echo a client's megabytes back


def clip(value: object, limit: int = 64) -> str:
    """repr(value), cut to `limit` characters with the rest counted (for echoing client input in errors)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text) - limit} more characters)"


def cut_message(msg: str) -> str:
    return msg if len(msg) <= MAX_MESSAGE_CHARS else f"{msg[:MAX_MESSAGE_CHARS]}… (message cut)"


def status_of(err: KvfleetError) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, err.code, grpc.StatusCode.INTERNAL)


def check_caller(ctx: ServiceContext, context: grpc.aio.ServicerContext, role: Role | frozenset[Role],
           method: str) -> Identity:
    ident = ctx.auth.authenticate(context.invocation_metadata())
    ctx.auth.authorize(ident, role, method)
    if not ctx.leader:
        raise Unavailable("this controller is a standby (another one holds the leader lock); retry, "
                          "or point the client at the leader")
    return ident


async def fail_call(ctx: ServiceContext, context: grpc.aio.ServicerContext, method: str, e: BaseException) -> None:
    if isinstance(e, KvfleetError):
        code, msg = status_of(e), str(e)
    else:
        log.exception("%s failed", method)
        code, msg = grpc.StatusCode.INTERNAL, f"internal error in {method}: {type(e).__name__}: {e} (see controller log)"
    ctx.metrics.rpc_errors.labels(method=method, code=code.name).inc()
    await context.abort(code, cut_message(msg), trailing_metadata=((ANSWERED_TRAILER, code.name),))


Handler = Callable[..., Awaitable[Any]]


def unary(role: Role | frozenset[Role]) -> Callable[[Handler], Handler]:
    """Wrap `async def M(self, request, context, ident)` (unary or client-streaming, or server-streaming
    writing with context.write and returning None) with auth and errors."""

    def wrap(fn: Handler) -> Handler:
        @functools.wraps(fn)
        async def method(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                if isinstance(request, Undecodable):  # before auth, as an unparseable request always was
                    await refuse(request, fn.__name__, context)
                elif hasattr(request, "__aiter__"):  # client streaming: each message is checked as it comes
                    request = checked_stream(request, fn.__name__, context)
                ident = check_caller(self.ctx, context, role, fn.__name__)
                with self.ctx.rpc_shares.hold(ident.tenant):
                    return await fn(self, request, context, ident)
            except grpc.aio.AbortError:
                raise
            except Exception as e:
                await fail_call(self.ctx, context, fn.__name__, e)

        return method

    return wrap


def server_stream(role: Role | frozenset[Role]) -> Callable[[Callable[..., AsyncIterator[Any]]], Callable[..., AsyncIterator[Any]]]:
    """Wrap `async def M(self, request, context, ident)` async generators with auth and errors."""

    def wrap(fn: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
        @functools.wraps(fn)
        async def method(self: Any, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            try:
                if isinstance(request, Undecodable):
                    await refuse(request, fn.__name__, context)
                ident = check_caller(self.ctx, context, role, fn.__name__)
                with self.ctx.rpc_shares.hold(ident.tenant):
                    async for msg in fn(self, request, context, ident):
                        yield msg
            except grpc.aio.AbortError:
                raise
            except Exception as e:
                await fail_call(self.ctx, context, fn.__name__, e)

        return method

    return wrap
