"""Fail-closed, lifecycle-aware routing over vLLM workers (DESIGN §9, reference §6).

A WARM verdict needs both: the (worker, dp_rank) is serving (not asleep, not paused, healthy),
and the request's leading blocks are resident on its GPU tier under the current epoch. Every
decision carries the epoch it was computed under. The worker registry and each rank's epoch and
last seq live in the store (controller/registry.py), so a new Router on the same store knows
every worker, trusts no warmth and rebuilds its index by replay from the persisted seq. The
router's own store calls run off the event loop (`blocking`).

The router reads a worker through `Worker.view()` only (a frozen WorkerView per decision), and
watchers change the index through `IndexSink` only.

Among the serving candidates the cheapest wins (controller/cost.py, docs/routing.md): prefill
tokens there, plus the work queued there (what this router sent and has not seen end: released
by the proxy, reconciled against /metrics, or expired), plus the warm prefixes its new blocks
would evict. Serving and proven warmth stay hard rules; cost only orders what they allow.

`route` runs in four named phases: hash and order, probe or look again, record the placement, build the decision.
What is kept of a route once decided, until it ends (record, release, move, expire, reconcile), is
controller/route_book.py's RouteBook.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence, Sized
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import zmq.asyncio

from controller.batch_route import MAX_BATCH_PROMPTS, Hashed
from controller.cost import CostConfig
from controller.demand import DemandLedger
from controller.hash_lane import INLINE_HASH_TOKENS, HashLane
from controller.index import PrefixIndex
from controller.inflight import InFlight
from controller.metrics import Metrics
from controller.ordering import CandidateOrder, Ordering, check_route_args, checked_chains
from controller.owned import OwnedLru
from controller.periodic import Periodic
from controller.registry import EpochTable, KvStore, WorkerRegistry, WorkerSpec
from controller.route_book import Movable, RouteBook
from controller.shadow import ShadowPools
from controller.tenant_branches import TenantBranches
from controller.vllm.events import AllBlocksCleared, BlockRemoved, BlockStored, Event
from controller.vllm.http import VllmHttp
from controller.vllm.subscriber import StreamLimits
from controller.vllm.watcher import Worker
from controller.worker_status import WorkerStatus, agreed_spec, error_status, resumed_ranks, status_row
from fleet.core import lifecycle as lc
from fleet.core.errors import AlreadyExists, InvalidArgument, NotFound
from fleet.core.lifecycle import Witness
from fleet.core.rank_state import RankState
from fleet.core.route_types import RouteCandidate, RouteDecision, verdict_of

__all__ = ["RouteCandidate", "RouteDecision", "Router", "RouterConfig", "WorkerSpec", "WorkerStatus"]
Blocking = Callable[..., Awaitable[Any]]  # runs a blocking call off the event loop (ServiceContext.blocking)
MAX_MOVABLE_ROUTES = 1 << 14  # a backstop: candidates are kept only while their route is tracked
LORA_MISS_LOOK_S = 0.5  # a route for an adapter (or model) no worker lists looks again at most this often per worker

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RouterConfig:
    reconcile_interval_s: float = 0.5
    probe_on_route: bool = False
    http_timeout_s: float = 2.0
    # a prefix-cache reset vLLM refuses while requests hold blocks is asked again, the worker taking no new
    # requests, for up to this long (controller/vllm/verbs.py, Worker._drained_reset); 0: ask once. A pause with
    # mode=wait, which vLLM answers once its requests have finished, waits this much past http_timeout_s
    reset_drain_s: float = 5.0
    # each worker's LoRA adapters are read again from its /v1/models this often (one GET, on the reconcile loop); a
    # route for an adapter no worker lists has them read again, at most once every LORA_MISS_LOOK_S per worker
    lora_refresh_s: float = 10.0
    # a rank whose worker computed prompts while none of its KV events arrived for this long is reported silent
    # (a warning, kvfleet_kv_events_silent; controller/vllm/silence.py)
    events_silent_s: float = 30.0
    stream: StreamLimits = field(default_factory=StreamLimits)
    cost: CostConfig = field(default_factory=CostConfig)


class Router:
    """The domain object the gRPC servicers call. Single event loop; its own store calls (start,
    registration) run through `blocking`, the controller's store threads (asyncio.to_thread alone)."""

    def __init__(
        self, store: KvStore, metrics: Metrics | None = None, config: RouterConfig | None = None,
        blocking: Blocking | None = None,
    ) -> None:
        self.store, self.metrics, self.cfg = store, metrics or Metrics(), config or RouterConfig()
        self.registry, self.epochs = WorkerRegistry(store), EpochTable(store)
        self._blocking: Blocking = blocking or asyncio.to_thread
        self.index = PrefixIndex()
        self._workers: dict[str, Worker] = {}
        self._session: aiohttp.ClientSession | None = None
        self._zctx: zmq.asyncio.Context | None = None
        c = self.cfg.cost
        self.flights = InFlight(c.inflight_ttl_s, c.reconcile_grace_s, c.untracked_request_tokens)
        self.branches = TenantBranches()  # per tenant, one bound (controller/tenant_branches.py)
        self.demand = DemandLedger(c.working_set_ttl_s)
        self.shadow = ShadowPools()
        # live tracked routes' candidates (chains, prefill), so a route the proxy sent elsewhere can move;
        # dropped when the route ends (release, TTL, reconcile, worker gone)
        # NOTE: past MAX_MOVABLE_ROUTES the tenant with the most loses its oldest: one tenant's flood of
        # tracked Routes evicted every other tenant's, whose MoveRoute then moved nothing
        # (the ordering, each prompt's number of tokens: one, or a batch's)
        self._alternatives: Movable = OwnedLru(MAX_MOVABLE_ROUTES)
        # what is kept of a route once decided, until it ends (controller/route_book.py)
        self.book = RouteBook(self._workers, self.index, self.flights, self.demand, self.shadow, self.metrics,
                              self._alternatives)
        self._ended, self._inflight_rows = self.book.ended, self.book.inflight_rows  # the book's, not copies
        self.index.observer = self._on_cache_event
        self.candidates = CandidateOrder(self._workers, self.index, self.flights, self.demand, self.branches,
                             lambda: self.cfg.cost, self._ended, self.shadow)
        self.hash_lane = HashLane(self.candidates, self.branches)  # long prompts (controller/hash_lane.py)
        self.metrics.inflight = self._inflight_rows  # read when scraped
        settle = functools.partial(self.book.settle, self.candidates.reconcile)
        self._settler = Periodic("kvfleet-inflight-settle", self.cfg.reconcile_interval_s, settle,
                                 on_error=lambda e: log.warning("in-flight ledger settle failed: %s", e))

    def set_cost_config(self, c: CostConfig) -> None:
        """New placement weights from now on; the in-flight ledger keeps its routes (new TTL, grace and untracked size)."""
        self.cfg = dataclasses.replace(self.cfg, cost=c)
        self.flights.ttl_s, self.flights.grace_s = c.inflight_ttl_s, c.reconcile_grace_s
        self.flights.default_tokens = c.untracked_request_tokens
        self.demand.ttl_s = c.working_set_ttl_s

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
        workers = []
        for name, raw in await self._blocking(self.registry.entries):
            try:
                spec = self.registry.decode(raw)
            except Exception:
                self.metrics.worker_errors.labels("start").inc()
                log.exception("worker %r: its stored spec is unreadable; skipped (re-register it)", name)
                continue
            workers.append(self._new_worker(spec, await self._blocking(resumed_ranks, self.epochs, spec, self.metrics)))
        await asyncio.gather(*(self._resume(w) for w in workers))

    @staticmethod
    async def _resume(w: Worker) -> None:
        try:
            await w.start(catch_up=True)
        except Exception as e:
            w.errors.failed("start", e)
            w.mark_down_contained("start_error")

    async def stop(self) -> None:
        if self.metrics.inflight == self._inflight_rows:  # a controller that stops leading reports no routes in flight
            self.metrics.inflight = None
        await self._settler.stop()
        for w in list(self._workers.values()):
            await w.stop()
        self._workers.clear()
        if self._session is not None:
            await self._session.close()
        if self._zctx is not None:
            self._zctx.term()

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
        spec = await agreed_spec(spec, VllmHttp(spec.url, self._session, self.cfg.http_timeout_s))
        await self._blocking(self.registry.put, spec)
        ranks = await self._blocking(self.epochs.next_epochs, spec)  # epochs stay monotonic across re-registration
        w = await self._launch(spec, ranks, catch_up=False)
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

    def _get(self, name: str) -> Worker:
        w = self._workers.get(name)
        if w is None:
            raise NotFound(
                f"no worker named {name!r}; register it first (known: {', '.join(sorted(self._workers))})"
            )
        return w

    async def lifecycle(
        self,
        name: str,
        verb: str,
        *,
        level: int | None = None,
        mode: str | None = None,
        tags: list[str] | None = None,
        clear_cache: bool | None = None,
        dp_rank: int | None = None,
        reset_running_requests: bool | None = None,
    ) -> Witness:
        """Drive one lifecycle verb through the controller and return its witness.

        NOTE: vLLM's verbs act on the whole engine (every DP rank); `dp_rank` only selects which
        rank's epoch the witness reports.
        """
        w = self._get(name)
        call = lc.plan(verb, level=level, mode=mode, tags=tags, clear_cache=clear_cache,
                       reset_running_requests=reset_running_requests)
        if dp_rank is not None and dp_rank not in w.ranks:
            ids = w.spec.dp_rank_ids
            raise InvalidArgument(f"dp_rank {dp_rank} out of range for {name} ({ids.start}..{ids.stop - 1})")
        wit = await w.lifecycle(call, settle=lambda: self._settle(name))
        return dataclasses.replace(wit, epoch=w.ranks[w.spec.dp_rank_start if dp_rank is None else dp_rank].epoch)

    async def _settle(self, name: str) -> None:
        """Wait until every tracked route decided for `name` has had the reconcile grace to reach it.

        NOTE: a verb first takes the worker out of routing, so nothing is added while this waits; but a route
        decided just before is still on its way (the proxy forwards it after the answer). A sleep that overtook it
        left the request queued on a sleeping engine (fleet-routing-real, short-chats, through the controller),
        and a reset that overtook a WARM route wiped the blocks it was counted on. A released route has ended and
        is not waited for; untracked routes (an SDK caller asking "where?") are not known here.
        """
        newest = self.flights.newest(name)
        if newest is not None and (wait := newest + self.flights.grace_s - time.monotonic()) > 0:
            self.metrics.lifecycle_settles.inc()
            await asyncio.sleep(wait)

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

    async def _looked_again(self, model: str, lora: str | None) -> bool:
        """A route that found no worker listing its adapter (NotFound) has the workers that could serve it look at
        their adapters again: it may have been loaded at runtime (vLLM's /v1/load_lora_adapter) since their last
        look. Each look begins after this route came, and at most one per LORA_MISS_LOOK_S per worker (routes at
        once share it), so such a route waits up to that long for its NotFound. True once they looked: order again.
        `model` may itself name an adapter (no `lora`): then every worker looks."""
        if not isinstance(self.candidates.none_serving(model, lora), NotFound):
            return False
        asked = time.monotonic()
        ws = [w for w in self._workers.values() if lora is None or w.spec.model == model]
        await asyncio.gather(*(w.loras_since(asked, LORA_MISS_LOOK_S) for w in ws))
        return bool(ws)

    async def route(
        self,
        token_ids: Sequence[int],
        model: str,
        *,
        cache_salt: str | None = None,
        lora: str | None = None,
        probe: bool | None = None,
        track: bool = False,
        owner: str | None = None,
        batch: Sequence[Sequence[int]] = (),
    ) -> RouteDecision:
        """Pick the cheapest serving (worker, rank).

        Only serving ranks are candidates, and only proven warmth (current epoch) lowers a cost.
        With `track` the request counts as in flight on the chosen rank until `release_route` (or
        the reconcile/TTL fallbacks); only `owner` (the tenant) may release it. The tenant's prompts over
        INLINE_HASH_TOKENS are hashed at most HASH_THREADS_PER_TENANT at a time (controller/hash_lane.py). A caller that will
        not release leaves `track` off: its requests are seen through /metrics alone.

        `token_ids` is a list or tuple; a long prompt may come as another sequence (a protobuf repeated field), made a
        list only in its hashing thread. The tenant's long prompts waiting for a thread hold at most
        LONG_WAIT_TOKENS_PER_TENANT tokens.

        `batch`: a batched request's later prompts (`token_ids` is its first; at most MAX_BATCH_PROMPTS in all): the
        candidates are costed by the whole batch, and every prompt is recorded where it goes (controller/batch_route.py).
        The decision's cached tokens are then the sum over the prompts. Its prompts count as one prompt of their total
        length for the hashing rules above.

        Raises:
            InvalidArgument: bad token ids, model or salt.
            ResourceExhausted: the tenant's long prompts waiting to be hashed would hold over LONG_WAIT_TOKENS_PER_TENANT.
            NotFound: no registered worker serves the model (or its LoRA).
            Unavailable: workers of the model are registered, and none is serving.
        """
        t0 = time.perf_counter()
        check_route_args((), model, cache_salt, lora)  # the cheap part; the tokens are checked off the loop
        if len(batch) >= MAX_BATCH_PROMPTS:
            raise InvalidArgument(f"a batch of {len(batch) + 1} prompts is over the route's limit of "
                                  f"{MAX_BATCH_PROMPTS}; route it by its first {MAX_BATCH_PROMPTS}")
        self.book.expire()
        # 1. hash the prompts and order the candidates (a long prompt's ids come back from its thread as a list)
        ordering, token_ids, batch = await self._ordered(token_ids, model, cache_salt, lora, owner, batch)
        # 2. probe the choice; where none serves, look again
        ordering = await self._looked_at(ordering, token_ids, model, cache_salt, lora, probe, owner, batch)
        # 3. record the placement: working set, block-pool shadow; a tracked route in flight, and movable
        sizes = (len(token_ids), *map(len, batch))
        route_id = self.book.record(ordering, sizes, track, owner)
        # 4. the decision, counted in the metrics
        return self._decision(ordering, route_id, cache_salt, sum(sizes), t0)

    async def _ordered(
        self, token_ids: Sequence[int], model: str, salt: str | None, lora: str | None, owner: str | None,
        batch: Sequence[Sequence[int]],
    ) -> tuple[Ordering, Sequence[int], Sequence[Sequence[int]]]:
        """Phase 1 of `route`: the candidates in order, and the prompt's and batch's ids as ordered. Hashed here, on
        the event loop, up to INLINE_HASH_TOKENS in all; longer, in a hashing thread (HashLane.ordered)."""
        num_tokens = sum(len(p) if isinstance(p, Sized) else INLINE_HASH_TOKENS + 1 for p in (token_ids, *batch))
        if not all(isinstance(p, list | tuple) for p in (token_ids, *batch)) or num_tokens > INLINE_HASH_TOKENS:
            return await self.hash_lane.ordered(token_ids, model, salt, lora, owner, batch, num_tokens)
        jobs = self.candidates.hash_jobs(model, lora)
        pre = checked_chains(jobs, token_ids, model, salt, lora)
        bpre = [Hashed(checked_chains(jobs, p, model, salt, lora), {}) for p in batch]
        ordering = self.candidates.order(token_ids, model, salt, lora, pre, owner=owner, batch=batch, batch_pre=bpre)
        return ordering, token_ids, batch

    async def _looked_at(
        self, ordering: Ordering, token_ids: Sequence[int], model: str, salt: str | None, lora: str | None,
        probe: bool | None, owner: str | None, batch: Sequence[Sequence[int]],
    ) -> Ordering:
        """Phase 2 of `route`: with `probe` (None: RouterConfig.probe_on_route) the choice is probed, failing over on
        a bad answer; where no candidate serves, the workers look at their adapters again (`_looked_again`).

        Raises:
            NotFound, Unavailable: still no candidate (CandidateOrder.none_serving).
        """
        if probe if probe is not None else self.cfg.probe_on_route:
            if not ordering.ordered:  # nobody serving as far as we know: one fresh look at every worker
                await asyncio.gather(*(w.reconcile_once() for w in self._workers.values()))
                ordering = self.candidates.order(token_ids, model, salt, lora, owner=owner, batch=batch)
            ordering = await self._probe(ordering, token_ids, model, salt, lora, owner, batch)
        if not ordering.ordered and await self._looked_again(model, lora):
            ordering = self.candidates.order(token_ids, model, salt, lora, owner=owner, batch=batch)
        if not ordering.ordered:
            raise self.candidates.none_serving(model, lora)
        return ordering

    def _decision(self, ordering: Ordering, route_id: str, salt: str | None, num_tokens: int,
                  t0: float) -> RouteDecision:
        """Phase 4 of `route`: the answer for `ordering`'s first candidate, every candidate listed cheapest first;
        the route counted in the metrics (`num_tokens`: its prompts' in all; `t0`: when it came)."""
        best = ordering.ordered[0]
        name, r, t = best.state.worker, best.state.dp_rank, best.terms
        cands = tuple(
            RouteCandidate(c.state.worker, c.state.dp_rank, c.terms.cached_tokens, c.terms) for c in ordering.ordered
        )
        self.book.observe(num_tokens, t, cands)
        self.metrics.route_latency.observe(time.perf_counter() - t0)
        v = self._workers[name].view()
        return RouteDecision(name, v.url, r, verdict_of(t.cached_tokens), t.cached_tokens, v.rank(r).epoch, salt or "",
                             cands, route_id, t, cands[1] if len(cands) > 1 else None)

    def release_route(self, route_id: str, owner: str | None = None) -> bool:
        """The routed request ended: its worker's in-flight load drops now (RouteBook.release: what it raises)."""
        return self.book.release(route_id, owner)

    def move_route(self, route_id: str, worker: str, dp_rank: int, owner: str | None = None) -> bool:
        """The caller sent the routed request to another of its candidates: its in-flight load, block-pool shadow and
        working-set record follow it (RouteBook.move: what it refuses and raises)."""
        return self.book.move(route_id, worker, dp_rank, owner)

    def _on_cache_event(self, key: tuple[str, int], ev: Event | None) -> None:
        """The index applied `ev` (None: dropped the rank): the shadow follows; a clear or a drop is a
        cache loss, so the rank's conversations leave its working set.

        An awaited clear (the one a verb of this controller queued) changes nothing here: the verb dropped
        the rank when it ran, and the routes seen since came after the clear. Forgetting them again turned
        their blocks into ghosts, and their BlockStored events then queued them head first, so the shadow
        predicted LRU evicting a prompt's first block where vLLM evicts its last (stale WARM routes).
        """
        if isinstance(ev, AllBlocksCleared) and ev.awaited:
            return
        if ev is None or isinstance(ev, AllBlocksCleared):
            self.demand.forget_rank(key)
            self.shadow.forget(key)
            return
        if (ev.medium or "GPU").upper() != "GPU":
            return
        # NOTE: the pool is made here once the capacity is known, not at the rank's first route: a restarted
        # controller (or a worker registered again) rebuilds the index by replay, and the shadow must see that
        # replay in stored order. Made at the first route, it started empty (every block free and unhashed)
        # beside a full index and predicted no eviction until a pool's worth of new blocks had gone by.
        pool = self.shadow.pool(key, self.book.pool_size(key))
        if pool is None:
            return
        if isinstance(ev, BlockStored):
            pool.stored(ev.block_hashes, time.monotonic(), ev.parent_block_hash)
        elif isinstance(ev, BlockRemoved):
            pool.removed(ev.block_hashes)

    async def _probe(
        self, ordering: Ordering, token_ids: Sequence[int], model: str, salt: str | None, lora: str | None,
        owner: str | None = None, batch: Sequence[Sequence[int]] = (),
    ) -> Ordering:
        """Route-time probe of the chosen worker; on a bad answer, fail over to the next one."""
        tried: set[str] = set()
        while ordering.ordered:
            name, r = ordering.ordered[0].state.worker, ordering.ordered[0].state.dp_rank
            if name in tried:
                return ordering  # probed during this call and still the best choice
            tried.add(name)
            w = self._workers[name]
            epoch = w.view().rank(r).epoch
            if await w.probe() and self._workers.get(name) is w and w.view().rank(r).epoch == epoch:
                return ordering  # NOTE: without the `is w`, a worker unregistered during its probe was still chosen
            self.metrics.stale_route_guard.labels("probe").inc()
            ordering = self.candidates.order(token_ids, model, salt, lora, owner=owner, batch=batch)
        return ordering
