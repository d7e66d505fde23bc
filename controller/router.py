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

`route` runs in four named phases: hash and order, probe or look again, record the placement, build the decision
(controller/route_phases.py). What is kept of a route once decided, until it ends (record, release, move, expire,
reconcile), is controller/route_book.py's RouteBook.

The Router's methods live in four modules, mixins on its one state: here its parts, `route`, release, move and the
index's cache events; controller/route_phases.py's RoutePhases (the route's phases), controller/router_workers.py's
RouterWorkers (start and stop, register, unregister, the listing) and controller/router_lifecycle.py's
RouterLifecycle (the lifecycle verbs).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import aiohttp
import zmq.asyncio

from controller.batch_route import MAX_BATCH_PROMPTS
from controller.cost import CostConfig
from controller.demand import DemandLedger
from controller.hash_lane import HashLane
from controller.index import PrefixIndex
from controller.inflight import InFlight
from controller.metrics import Metrics
from controller.ordering import CandidateOrder, check_route_args
from controller.owned import OwnedLru
from controller.periodic import Periodic
from controller.registry import EpochTable, KvStore, WorkerRegistry, WorkerSpec
from controller.route_book import Movable, RouteBook
from controller.route_phases import LORA_MISS_LOOK_S, RoutePhases
from controller.router_lifecycle import RouterLifecycle
from controller.router_workers import Blocking
from controller.shadow import ShadowPools
from controller.tenant_branches import TenantBranches
from controller.vllm.events import AllBlocksCleared, BlockRemoved, BlockStored, Event
from controller.vllm.subscriber import StreamLimits
from controller.vllm.watcher import Worker
from controller.worker_status import WorkerStatus
from fleet.core.errors import InvalidArgument
from fleet.core.route_types import RouteCandidate, RouteDecision

__all__ = [
    "LORA_MISS_LOOK_S",
    "RouteCandidate",
    "RouteDecision",
    "Router",
    "RouterConfig",
    "WorkerSpec",
    "WorkerStatus",
]
MAX_MOVABLE_ROUTES = 1 << 14  # a backstop: candidates are kept only while their route is tracked

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


class Router(RouterLifecycle, RoutePhases):
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
        self._registering: set[str] = set()
        self._stopped = False
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
        if isinstance(ev, BlockStored) and self.cfg.cost.scheduled_by_events:
            self.flights.scheduled(key, ev.block_hashes)  # their prefill no longer waits (InFlight.scheduled)
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

