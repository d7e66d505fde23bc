"""The router's workers (controller/router.py's Router takes these as a mixin): its start and stop, the worker
registry (register, unregister, write back, look up) and the listing of every (worker, rank).

`start` opens the clients every Worker shares (one aiohttp session, one ZMQ context), starts the in-flight ledger's
settle loop and resumes every worker the store knows, cold, its index rebuilt by replay; `stop` undoes it. A worker is
registered once it has been validated against its /v1/models (controller/worker_status.py agreed_spec) and persisted
(controller/registry.py): its ranks' epochs move on, so its warmth starts empty. Unregistering drops all the router
keeps of it: its index, its routes in flight, its working set, its block-pool shadow and the /metrics looks its
ranks were reconciled with.

These share the Router's parts: its store and registry, its live `_workers` (the RouteBook and the candidate ordering
read the same dict), index, in-flight ledger, working set, shadow and metrics. Single event loop; the store calls run
through `blocking`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import aiohttp
import zmq.asyncio

from controller.demand import DemandLedger
from controller.index import PrefixIndex
from controller.inflight import Flight, InFlight
from controller.metrics import Metrics
from controller.ordering import CandidateOrder
from controller.periodic import Periodic
from controller.registry import EpochTable, KvStore, WorkerRegistry, WorkerSpec
from controller.shadow import ShadowPools
from controller.vllm.http import VllmHttp
from controller.vllm.watcher import Worker
from controller.worker_status import WorkerStatus, agreed_spec, error_status, resumed_ranks, status_row
from fleet.core.errors import AlreadyExists, InvalidArgument, NotFound
from fleet.core.rank_state import RankState

if TYPE_CHECKING:
    from controller.router import RouterConfig

Blocking = Callable[..., Awaitable[Any]]  # runs a blocking call off the event loop (ServiceContext.blocking)

log = logging.getLogger("controller.router")  # the router's own log, as before the move


class RouterWorkers:
    """The registered workers: started, stopped, registered, unregistered, looked up and listed."""

    store: KvStore
    metrics: Metrics
    cfg: RouterConfig
    registry: WorkerRegistry
    epochs: EpochTable
    index: PrefixIndex
    flights: InFlight
    demand: DemandLedger
    shadow: ShadowPools
    candidates: CandidateOrder
    _blocking: Blocking
    _workers: dict[str, Worker]
    _registering: set[str]  # names whose registration is checking, storing or starting them
    _stopped: bool
    _session: aiohttp.ClientSession | None
    _zctx: zmq.asyncio.Context | None
    _settler: Periodic
    _ended: Callable[[list[Flight], str], None]
    _inflight_rows: Callable[[], list[tuple[str, float, float]]]

    async def start(self) -> None:
        """Open clients and resume every worker the store knows (cold, rebuilt by replay).

        NOTE: one worker's bad record or failing start is contained to that worker (counted in
        kvfleet_worker_errors_total{where="start"}); it used to abort the whole start. The workers start side by
        side: one after another, each one's catch-up replays (up to StreamLimits' deadline per rank) held back the
        next one's ingestion, and the sum held the start (a controller leads only once it returns).
        """
        self._session = aiohttp.ClientSession()
        self._zctx = zmq.asyncio.Context()
        await self._settler.start()
        await self.load_registry()

    async def load_registry(self) -> list[str]:
        """Resume every worker the store holds that this router does not watch yet (cold, rebuilt by replay); return
        their names. At start, and again where registrations may have come back since (the store lost its data and
        another controller wrote back the ones it held: Controller._store_lost, Controller._lead). A name registered
        or unregistered meanwhile is this router's own and is left alone.

        NOTE: the registry was read once, at start: a standby that took the lead while a flush had emptied the store
        (the lock went with it) watched no worker for good, though the old leader wrote its registrations back.
        """
        workers = []
        for name, raw in await self._blocking(self.registry.entries):
            if name in self._workers or name in self._registering:
                continue
            try:
                spec = self.registry.decode(raw)
            except Exception:
                self.metrics.worker_errors.labels("start").inc()
                log.exception("worker %r: its stored spec is unreadable; skipped (re-register it)", name)
                continue
            ranks = await self._blocking(resumed_ranks, self.epochs, spec, self.metrics)
            if self._stopped:  # a worker started now would outlive the router
                break
            if spec.name not in self._workers and spec.name not in self._registering:  # not registered meanwhile
                workers.append(self._new_worker(spec, ranks))
        await asyncio.gather(*(self._resume(w) for w in workers))
        return [w.spec.name for w in workers]

    @staticmethod
    async def _resume(w: Worker) -> None:
        try:
            await w.start(catch_up=True)
        except Exception as e:
            w.errors.failed("start", e)
            w.mark_down_contained("start_error")

    async def stop(self) -> None:
        self._stopped = True
        if self.metrics.inflight == self._inflight_rows:  # a controller that stops leading reports no routes in flight
            self.metrics.inflight = None
        await self._settler.stop()
        for w in list(self._workers.values()):
            await w.stop()
        self._workers.clear()
        if self._session is not None:
            await self._session.close()
        if self._zctx is not None:
            # NOTE: term() waits for every socket of the context to be closed, on the event loop's own thread: a
            # socket still held by a coroutine this stop does not own (a worker resumed from the store by
            # load_registry, awaiting its catch-up replay) could never close, and the controller's stop hung for good
            # (a loaded CI run, twice). destroy closes what is left first; such a coroutine's next call fails, caught
            self._zctx.destroy(linger=0)

    async def _launch(
        self, spec: WorkerSpec, ranks: dict[int, RankState] | None, *, catch_up: bool
    ) -> Worker:
        w = self._new_worker(spec, ranks)
        await w.start(catch_up=catch_up)
        return w

    def _new_worker(self, spec: WorkerSpec, ranks: dict[int, RankState] | None) -> Worker:
        assert self._session is not None and self._zctx is not None, "Router.start() first"
        w = Worker(
            spec,
            store=self.store,
            metrics=self.metrics,
            index=self.index,
            cfg=self.cfg,
            session=self._session,
            zctx=self._zctx,
            ranks=ranks,
        )
        self._workers[spec.name] = w
        return w

    async def register_worker(self, spec: WorkerSpec) -> WorkerStatus:
        """Validate, persist and start watching a worker; its warmth starts empty."""
        if not isinstance(spec, WorkerSpec):
            raise InvalidArgument("register_worker takes a WorkerSpec")
        known = self._workers.get(spec.name)
        if known is not None:
            if known.spec == dataclasses.replace(spec, hash_algo=spec.hash_algo or known.spec.hash_algo):
                return status_row(known, known.spec.dp_rank_start, self.index)
            raise AlreadyExists(f"worker {spec.name!r} is registered with another spec; unregister it first")
        assert self._session is not None, "Router.start() first"
        self._registering.add(spec.name)  # stored before it is watched: load_registry leaves it alone meanwhile
        try:
            spec = await agreed_spec(spec, VllmHttp(spec.url, self._session, self.cfg.http_timeout_s))
            await self._blocking(self.registry.put, spec)
            ranks = await self._blocking(self.epochs.next_epochs, spec)  # epochs stay monotonic across re-registration
            w = await self._launch(spec, ranks, catch_up=False)
        finally:
            self._registering.discard(spec.name)
        return status_row(w, spec.dp_rank_start, self.index)  # its first rank's row

    async def rewrite_records(self) -> None:
        """Write back every registered worker's record and rank states (the store lost its data: Controller._store_lost).
        NOTE: on the event loop, as a rank's own persist: a put cannot land after an unregister's delete of the same
        name (that delete runs once the worker has stopped, after this)."""
        for w in list(self._workers.values()):
            try:
                self.registry.put(w.spec)
            except Exception as e:  # noqa: BLE001  # the store failed again: the next loss report writes them
                log.warning("could not write back worker %s's registration after the store lost its data: %s",
                            w.spec.name, e)
                continue
            for rank in w.ranks:
                w.persist(rank)
        log.warning("the store lost its data: wrote back %d worker registrations and their rank states",
                    len(self._workers))

    async def unregister_worker(self, name: str) -> None:
        w = self._get(name)
        await w.stop()
        try:
            # NOTE: deleted before the worker leaves memory: a registration of the same name that
            # starts meanwhile sees it still known, so the delete cannot land after its put
            await self._blocking(self.registry.delete, name)
        finally:
            del self._workers[name]
            self.index.drop_worker(name)
            self._ended(self.flights.drop_worker(name), "unregistered")
            for r in w.ranks:
                self.demand.forget_rank((name, r))
            self.shadow.drop_worker(name)
            self.candidates.drop_worker(name)

    def _get(self, name: str) -> Worker:
        w = self._workers.get(name)
        if w is None:
            raise NotFound(
                f"no worker named {name!r}; register it first (known: {', '.join(sorted(self._workers))})"
            )
        return w

    def workers(self) -> list[WorkerStatus]:
        """Every (worker, rank); a worker whose state cannot be read lists as "error", not serving."""
        out: list[WorkerStatus] = []
        for w in self._workers.values():
            try:
                rows = [status_row(w, r, self.index) for r in w.ranks]
            except Exception as e:
                w.errors.failed("status", e)
                rows = [error_status(w.spec, r) for r in w.spec.dp_rank_ids]
            else:
                w.errors.ok("status")
            out += rows
        return out

    def worker(self, name: str) -> Worker:
        return self._get(name)
