"""What every servicer shares: the service context, auth, and error -> status mapping.

Servicers are thin: authenticate, translate proto -> domain, call the core, translate back. Every
failure leaves as a gRPC status with a message a person can act on; nothing crashes the server.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc

from controller.auth import Authenticator, Identity, Role
from controller.edge import Undecodable, checked_stream, refuse
from controller.metrics import Metrics
from controller.quotas import SessionLimits
from controller.uploads import UploadGate, UploadLimits
from controller.verdicts import Judge
from fleet.errors import KvfleetError, Unavailable
from fleet.quarantine.layered import DetectorConfig
from workers.placement import NODE_KV_BYTES

log = logging.getLogger("kvfleet.controller")
T = TypeVar("T")
DEFAULT_MAX_ROUTE_TOKENS = 1 << 20
DEFAULT_MAX_BLOB_BYTES_PER_TENANT = 1 << 30  # --max-blob-bytes-per-tenant (0: no quota)


@dataclass(slots=True)
class ServiceContext:
    """Dependencies of the servicers. `leader` gates every kvfleet RPC (standby -> UNAVAILABLE)."""

    auth: Authenticator
    metrics: Metrics
    store: Any  # fleet.cas.BlobStore
    router: Any  # controller.router.Router, or None before it started
    max_blob_bytes: int
    store_url: str = ""
    ray_address: str | None = None  # the Ray cluster session actors run on (None: local / RAY_ADDRESS)
    store_gc: Any = None  # controller.store_gc.StoreGc (the CollectGarbage RPC and the leader's schedule)
    kernel_fleet: Any = None  # workers.fleet.KernelFleet, once the first session call built it
    fleet_metrics: Any = None  # controller.fleet_metrics.FleetMetricsPoller
    on_stop: list[Callable[[], None]] = field(default_factory=list)  # run by Controller.stop
    executor: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(4, thread_name_prefix="kvfleet-store"))
    leader: bool = True
    uploads: UploadGate = field(default_factory=lambda: UploadGate(UploadLimits()))
    max_route_tokens: int = DEFAULT_MAX_ROUTE_TOKENS  # a Route longer than this is refused (--max-route-tokens)
    blob_bytes_per_tenant: int = 0  # blob bytes a tenant may have stored, 0: no quota (--max-blob-bytes-per-tenant)
    session_limits: SessionLimits = field(default_factory=SessionLimits)  # per-tenant quotas, lanes, idle TTL
    node_kv_bytes: int = NODE_KV_BYTES  # KV budget of one Ray node of the session fleet (--node-kv-bytes)
    detector: DetectorConfig = field(default_factory=DetectorConfig)  # the Judge's policy (--detector-layers)
    detector_tenants: dict[str, DetectorConfig] = field(default_factory=dict)  # --detector-tenant overrides
    _judge: Judge | None = None
    _judge_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def judge(self) -> Judge:
        """The controller's one Judge (proxy verdicts and session admissions), built on first use: calls that
        arrive while it loads wait for that one (loading the encoder takes seconds)."""
        async with self._judge_lock:
            if self._judge is None:
                self._judge = await self.blocking(Judge, self.store, self.detector, self.detector_tenants)
        return self._judge

    async def blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a blocking store call off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, functools.partial(fn, *args))

    def need_router(self) -> Any:
        if self.router is None:
            raise Unavailable("the router is not running on this controller yet; retry shortly")
        return self.router


MAX_MESSAGE_CHARS = 1000  # an error message longer than this is cut: never echo a client's megabytes back


def clip(value: object, limit: int = 64) -> str:
    """repr(value), cut to `limit` characters with the rest counted (for echoing client input in errors)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text) - limit} more characters)"


def _cut(msg: str) -> str:
    return msg if len(msg) <= MAX_MESSAGE_CHARS else f"{msg[:MAX_MESSAGE_CHARS]}… (message cut)"


def status_of(err: KvfleetError) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, err.code, grpc.StatusCode.INTERNAL)


def _check(ctx: ServiceContext, context: grpc.aio.ServicerContext, role: Role | frozenset[Role],
           method: str) -> Identity:
    ident = ctx.auth.authenticate(context.invocation_metadata())
    ctx.auth.authorize(ident, role, method)
    if not ctx.leader:
        raise Unavailable("this controller is a standby (another one holds the leader lock); retry, "
                          "or point the client at the leader")
    return ident


async def _fail(ctx: ServiceContext, context: grpc.aio.ServicerContext, method: str, e: BaseException) -> None:
    if isinstance(e, KvfleetError):
        code, msg = status_of(e), str(e)
    else:
        log.exception("%s failed", method)
        code, msg = grpc.StatusCode.INTERNAL, f"internal error in {method}: {type(e).__name__}: {e} (see controller log)"
    ctx.metrics.rpc_errors.labels(method=method, code=code.name).inc()
    await context.abort(code, _cut(msg))


Handler = Callable[..., Awaitable[Any]]


def unary(role: Role | frozenset[Role]) -> Callable[[Handler], Handler]:
    """Wrap `async def M(self, request, context, ident)` (unary or client-streaming) with auth and errors."""

    def wrap(fn: Handler) -> Handler:
        @functools.wraps(fn)
        async def method(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                if isinstance(request, Undecodable):  # before auth, as an unparseable request always was
                    await refuse(request, fn.__name__, context)
                elif hasattr(request, "__aiter__"):  # client streaming: each message is checked as it comes
                    request = checked_stream(request, fn.__name__, context)
                ident = _check(self.ctx, context, role, fn.__name__)
                return await fn(self, request, context, ident)
            except grpc.aio.AbortError:
                raise
            except Exception as e:
                await _fail(self.ctx, context, fn.__name__, e)

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
                ident = _check(self.ctx, context, role, fn.__name__)
                async for msg in fn(self, request, context, ident):
                    yield msg
            except grpc.aio.AbortError:
                raise
            except Exception as e:
                await _fail(self.ctx, context, fn.__name__, e)

        return method

    return wrap
