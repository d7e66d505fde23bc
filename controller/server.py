"""The controller's grpc.aio server: kvfleet.v1 services, gRPC health and reflection, graceful stop.

    ctl = await build_server(ControllerConfig(listen="127.0.0.1:0", store_url="sqlite:///x.db"))
    ...  # clients talk to ctl.address
    await ctl.stop(grace=5)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from controller.auth import Authenticator, TokenBook
from controller.config import ControllerConfig
from controller.edge import DecodeGuard, server_credentials
from controller.fleet_metrics import FleetMetricsPoller
from controller.judge_lanes import JudgeLanes
from controller.kernel_placement import set_kernel_placement, write_back_spec
from controller.leader import FencedStore, LeaderLock, make_leader_lock
from controller.metrics import Metrics
from controller.servicers import SERVICE_NAMES, ServiceContext, add_servicers
from controller.servicers.common import RpcShares
from controller.servicers.fleet import redact
from controller.store_gc import GcConfig, StoreGc
from controller.store_probe import StoreProbe
from controller.uploads import UploadGate
from fleet.core.errors import InvalidArgument
from fleet.core.quarantine.detector_config import DetectorConfig

log = logging.getLogger("kvfleet.controller")
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Controller:
    """A running controller: `address`, `port`, `ctx` (store, router, auth, metrics) and `stop()`."""

    def __init__(self, cfg: ControllerConfig, server: grpc.aio.Server, port: int, ctx: ServiceContext,
                 health_servicer: Any, router_config: Any) -> None:
        self.cfg, self.server, self.port, self.ctx = cfg, server, port, ctx
        self.health, self._router_config = health_servicer, router_config
        self._lead_task: asyncio.Task[None] | None = None
        self._lock: LeaderLock | None = None
        self.store_probe = StoreProbe(ctx.store, ctx.metrics, health_servicer, cfg.store_ping_interval_s,
                                      on_lost=self._store_lost, on_unfit=lambda: self._set_serving(self.ctx.leader))
        self.stopped = False

    async def _store_lost(self) -> None:
        """After the store lost its data (the store probe calls it): write back the cache_salt secret this controller
        holds (unless another controller wrote one first, or it came from the config), so one started later derives
        the same salts; the kernel spec it holds, likewise (controller/kernel_placement.py); and, as leader, the
        worker registrations and rank states it holds, so one started later (a restart, the next leader) watches the
        same workers. NOTE: before, the registrations went with the data: the next controller started with no worker,
        and every request was refused until each was registered again."""
        if not self.cfg.salt_secret:
            ns, key = SALT_SECRET_KEY
            await asyncio.to_thread(self.ctx.store.kv_swap, ns, key, None, self.ctx.auth.salt_secret)
        if self.ctx.kernel_spec is not None:
            await asyncio.to_thread(write_back_spec, self.ctx.store, self.ctx.kernel_spec)
        if self.ctx.router is not None:
            await self.ctx.router.rewrite_records()
        await self._reload_registry("the store lost its data")

    async def _reload_registry(self, why: str, delay_s: float = 0.0) -> None:
        """As leader, after `delay_s`, watch the workers the store holds and the router does not: registrations
        another controller wrote back after a loss (Router.load_registry). NOTE: a standby that took the lead after a
        flush (the lock went with the data) read an empty registry once and watched no worker for good, though the
        old leader wrote its registrations back."""
        await asyncio.sleep(delay_s)
        router = self.ctx.router
        if router is None or not self.ctx.leader:
            return
        try:
            started = await router.load_registry()
        except Exception as e:  # noqa: BLE001  # the store failed again: the next loss or lead reads it again
            log.warning("could not read the worker registry again (%s): %s", why, e)
            return
        if started:
            log.warning("%s: now watching %d more workers the store holds: %s", why, len(started), ", ".join(started))

    @property
    def address(self) -> str:
        return f"{self.cfg.listen.rsplit(':', 1)[0]}:{self.port}"

    async def _set_serving(self, on: bool) -> None:
        """Serving: leading, on a store that can keep its data (not one that evicts keys: controller/store_probe.py)."""
        on = on and self.store_probe.unfit is None
        for name in ("", *SERVICE_NAMES):
            await self.health.set(name, SERVING if on else NOT_SERVING)

    async def become_leader(self) -> None:
        if self.cfg.start_router and self.ctx.router is None:
            from controller.router import Router, RouterConfig

            lock = self._lock
            store = self.ctx.store if lock is None else \
                FencedStore(self.ctx.store, lambda: time.monotonic() < lock.valid_until)  # (controller/leader.py)
            router = Router(store, self.ctx.metrics, self._router_config or RouterConfig(),
                            blocking=self.ctx.blocking)  # its store calls share the store's threads
            try:
                await router.start()
            except BaseException:  # failed, or cancelled (the lease was lost meanwhile): nothing of it stays open
                await router.stop()
                raise
            self.ctx.router = router
        self.ctx.leader = True
        await self.ctx.store_gc.start()
        await self._set_serving(True)

    async def step_down(self) -> None:
        self.ctx.leader = False
        await self._set_serving(False)
        await self.ctx.store_gc.stop()
        if self.ctx.router is not None and self.store_probe.scheduled:
            # NOTE: a flush takes the leader lock with the data: the leader's renew found it gone and it stepped down
            # before its probe found the loss, and the registrations it held went with it. Probed here, its write-back
            # runs while its lease still holds (FencedStore refuses it after), for the next leader to read.
            try:
                await self.store_probe.probe()
            except Exception as e:  # noqa: BLE001  # the write-back failed: standing by must not
                log.warning("controller on %s could not write back after the store lost its data: %s", self.address, e)
        router, self.ctx.router = self.ctx.router, None
        if router is not None:
            await router.stop()

    async def _lead(self, lock: LeaderLock) -> None:
        """Standby until the lock is ours; serve while we keep renewing it; step down when we cannot."""
        self._lock = lock
        while True:
            try:
                await lock.acquire()
            except Exception:  # NOTE: an error here ended this task: the controller never led again
                log.exception("controller on %s could not ask for the leader lock; asking again", self.address)
                await asyncio.sleep(lock.ttl_s / 5)
                continue
            log.info("controller on %s took the leader lock", self.address)
            # NOTE: renewed from the moment it is taken, while the router starts too: a start that outlasted the lease
            # (a worker's catch-up replay or HTTP that does not answer, up to their deadlines) lost the lock as soon
            # as it was done, stepped down and started over; a lease lost during the start now ends the start
            hold = asyncio.create_task(self._hold(lock))
            become = asyncio.create_task(self.become_leader())
            # the old leader writes back what a flush took (with the lock) until its lease ends: read it then
            again = asyncio.create_task(self._reload_registry("took the lead", lock.ttl_s))
            try:
                await asyncio.wait((hold, become), return_when=asyncio.FIRST_COMPLETED)
                if become.done():  # started (or failed: raised here): lead until a renew fails
                    become.result()
                    await hold
                log.warning("controller on %s lost the leader lock; standing by", self.address)
            except Exception:
                log.exception("controller on %s failed while leading; handing the lock on", self.address)
                await lock.release()
                await asyncio.sleep(lock.ttl_s)
            finally:
                hold.cancel()
                again.cancel()
                if not become.done():  # the lease lost during the start, or this task cancelled: the start ends
                    become.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await become
            await self.step_down()

    async def _hold(self, lock: LeaderLock) -> None:
        """Renew the lock every ttl/3; return once a renew fails (the lease is lost, or cannot be shown held)."""
        while True:
            await asyncio.sleep(lock.ttl_s / 3)
            if not await self._renewed(lock):
                return

    @staticmethod
    async def _renewed(lock: LeaderLock) -> bool:
        """Renew the lock, or give it up (False) once its lease runs out by our clock (LeaderLock.valid_until),
        whatever the renew is doing: a standby may take it from then on."""
        left = lock.valid_until - time.monotonic()
        try:
            return await asyncio.wait_for(lock.renew(), max(left, 0.0) if left != float("inf") else None)
        except TimeoutError:
            return False

    async def stop(self, grace: float | None = 5.0) -> None:
        """Graceful stop: NOT_SERVING, drain in-flight RPCs for `grace` s, stop the router, close the store."""
        if self.stopped:
            return
        self.stopped = True
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)
        if self._lead_task is not None:
            self._lead_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):  # NOTE: its error skipped the rest of the stop
                await self._lead_task
        if self._lock is not None:
            with contextlib.suppress(Exception):
                await self._lock.release()
                await self._lock.close()
        if self.ctx.router is not None:
            await self.ctx.router.stop()
        await self.ctx.store_gc.stop(drain=True)  # a run whose caller is gone ends before the store closes
        await self.store_probe.stop()
        await self.ctx.fleet_metrics.stop()
        await self.ctx.judge_lanes.aclose()  # queued verdicts dropped, running ones finish before the store closes
        for hook in self.ctx.on_stop:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(hook)
        self.ctx.executor.shutdown(wait=True)
        self.ctx.store.close()

    async def wait(self) -> None:
        await self.server.wait_for_termination()


SALT_SECRET_KEY = ("controller", "cache_salt_secret")


def _salt_secret(store: Any, cfg: ControllerConfig) -> bytes:
    """The cache_salt secret must survive restarts (or every warm prefix would go cold): keep it in the store."""
    if cfg.salt_secret:
        return cfg.salt_secret
    secret = store.kv_get(*SALT_SECRET_KEY)
    if not secret:
        # NOTE: a compare-and-set: two controllers starting at once on a new store both found none, and each
        # overwrote the other's; the first kept serving with a secret no later controller would use, so its tenants'
        # warm prefixes went cold at the next failover (review finding)
        store.kv_swap(*SALT_SECRET_KEY, None, secrets.token_bytes(32))
        secret = store.kv_get(*SALT_SECRET_KEY)
    return bytes(secret)


def _bind(server: grpc.aio.Server, cfg: ControllerConfig) -> int:
    try:
        if cfg.tls_cert and cfg.tls_key:
            creds = server_credentials(cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca)
            port = server.add_secure_port(cfg.listen, creds)
        else:
            port = server.add_insecure_port(cfg.listen)
    except RuntimeError as e:
        port, why = 0, str(e)
    else:
        why = "address in use or not local"
    if not port:
        raise InvalidArgument(f"cannot listen on {cfg.listen}: {why}; pick another --listen HOST:PORT")
    return int(port)


async def build_server(cfg: ControllerConfig, *, metrics: Metrics | None = None, store: Any = None,
                       router_config: Any = None) -> Controller:
    """Open the store, register services + health + reflection, start serving; return the Controller.

    Args:
        cfg: the controller configuration.
        metrics: the Metrics to record into (a fresh one if None).
        store: an already open fleet.cas store (tests); opened from cfg.store_url if None.
        router_config: a controller.router.RouterConfig (its defaults if None).
    """
    if store is None:
        from fleet.cas import open_store

        store = await asyncio.to_thread(open_store, cfg.store_url, max_blob_bytes=cfg.max_blob_bytes)
    book = TokenBook(cfg.tokens_file) if cfg.tokens_file else None
    auth = Authenticator(book, await asyncio.to_thread(_salt_secret, store, cfg))
    store_limit = getattr(getattr(store, "cfg", None), "max_blob_bytes", cfg.max_blob_bytes)
    limit = min(cfg.max_blob_bytes, int(store_limit))
    ctx = ServiceContext(auth=auth, metrics=metrics or Metrics(), store=store, router=None, max_blob_bytes=limit,
                         store_url=cfg.store_url, ray_address=cfg.ray_address, leader=False,
                         executor=ThreadPoolExecutor(cfg.store_threads, thread_name_prefix="kvfleet-store"),
                         uploads=UploadGate(cfg.uploads), max_route_tokens=cfg.max_route_tokens,
                         blob_bytes_per_tenant=cfg.max_blob_bytes_per_tenant,
                         verdicts_per_tenant=cfg.max_verdicts_per_tenant,
                         session_limits=cfg.sessions, node_kv_bytes=cfg.node_kv_bytes,
                         node_max_sessions=cfg.node_max_sessions,
                         detector=DetectorConfig(layers=cfg.detector_layers, encoder_gate=cfg.detector_encoder_gate,
                                                  encoder_max_fragmentation=cfg.detector_encoder_max_fragmentation),
                         detector_tenants=dict(cfg.detector_tenants), judge_lanes=JudgeLanes(cfg.judge),
                         rpc_shares=RpcShares(cfg.grpc_limits.max_concurrent_rpcs, one_tenant=book is None))
    ctx.store_gc = StoreGc(store, ctx.metrics, GcConfig(cfg.gc_interval_s, cfg.verdict_ttl_s), ctx.blocking)
    if cfg.kernel:  # before any session call builds the fleet from the stored spec
        ctx.kernel_spec = await asyncio.to_thread(set_kernel_placement, store, cfg.kernel)
    ctx.fleet_metrics = FleetMetricsPoller(lambda: ctx.kernel_fleet, ctx.metrics, cfg.fleet_metrics_interval_s)
    await ctx.fleet_metrics.start()
    server = grpc.aio.server(interceptors=[DecodeGuard()], options=cfg.grpc_limits.options(),
                             maximum_concurrent_rpcs=cfg.grpc_limits.max_concurrent_rpcs)
    names = add_servicers(server, ctx)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((*names, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    try:
        port = _bind(server, cfg)
    except BaseException:
        await ctx.fleet_metrics.stop()  # NOTE: the only task started by now; a test process outlives the refusal
        raise
    await server.start()
    ctl = Controller(cfg, server, port, ctx, health_servicer, router_config)
    await ctl._set_serving(False)
    await ctl.store_probe.start()  # "kvfleet.store" and kvfleet_store_up, whoever leads (controller/store_probe.py)
    if cfg.leader_election:
        ctl._lead_task = asyncio.create_task(ctl._lead(make_leader_lock(cfg.store_url, cfg.leader_ttl_s)))
    else:
        await ctl.become_leader()
    log.info("controller listening on %s (store %s)", ctl.address, redact(cfg.store_url))
    return ctl
