"""What the router keeps of a route once it is decided, until the route ends (docs/routing.md, "In flight").

A decision is recorded (`record`): its conversation now lives on the chosen rank (the working set,
controller/demand.py) and its new blocks in that rank's block-pool shadow (controller/shadow_pool.py); a tracked
route also counts in flight there (controller/inflight.py) and keeps its candidates, so the caller may `move` it to
another. It ends by `release` (the proxy's answer ended), or `ended` tells of the ledger dropping it (TTL,
reconcile against /metrics, its worker unregistered); `settle` runs the TTL and the reconcile between routes, and
`observe` counts every decision in the metrics.

The RouteBook shares the Router's parts (controller/router.py): its live worker registry (read, never changed
here), index, in-flight ledger, working set, shadow and metrics. Single event loop, like the Router.
"""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import Callable, Mapping

from controller.demand import DemandLedger
from controller.index import PrefixIndex, RankKey
from controller.inflight import PENDING_BLOCKS, Flight, InFlight
from controller.metrics import Metrics
from controller.ordering import Ordering
from controller.owned import OwnedLru
from controller.shadow import ShadowPools
from controller.view import WorkerView
from controller.vllm.watcher import Worker
from fleet.core.errors import FailedPrecondition, InvalidArgument
from fleet.core.route_types import RouteCandidate, RouteCost, verdict_of

_ROUTE_ID = re.compile(r"^[0-9a-f]{32}$")
# a tracked route's ordering and each prompt's number of tokens (one, or a batch's), kept while it may move
Movable = OwnedLru[str, tuple[Ordering, tuple[int, ...]]]


class RouteBook:
    """The bookkeeping of decided routes: record, release, move, end; `settle` between routes."""

    def __init__(
        self, workers: Mapping[str, Worker], index: PrefixIndex, flights: InFlight, demand: DemandLedger,
        shadow: ShadowPools, metrics: Metrics, alternatives: Movable,
    ) -> None:
        """`alternatives`: where tracked routes' candidates are kept (sized by the router: MAX_MOVABLE_ROUTES)."""
        self.workers, self.index, self.flights, self.demand = workers, index, flights, demand
        self.shadow, self.metrics, self.alternatives = shadow, metrics, alternatives
        self._routed = self._matched = 0  # prompt tokens routed, and of those proven warm where they went

    def record(self, ordering: Ordering, sizes: tuple[int, ...], track: bool, owner: str | None) -> str:
        """The decision (`ordering`'s first candidate) made: this turn's conversation now lives on its rank, a batch's
        every prompt's too (`sizes`: each prompt's tokens); with `track` it counts in flight there and keeps its
        candidates. Returns its route id ("" untracked)."""
        best = ordering.ordered[0]
        key = (best.state.worker, best.state.dp_rank)
        placed = ordering.chains.get(key)
        route_id = secrets.token_hex(16) if track else ""
        if placed is not None:
            now = time.monotonic()
            for part, (chain, nshared, group) in enumerate((placed, *ordering.batch.get(key, ()))):
                self.demand.place(key, chain, nshared, now, group, owner)
                self._shadow_route(key, route_id, chain, sizes[part], now, owner, part)
        if track:
            last_hash = ordering.last_hash.get(key)
            self.flights.add(Flight(route_id, key, best.terms.prefill_tokens, last_hash, owner, time.monotonic(),
                                    _blocks(placed)))
            if len(ordering.ordered) > 1:
                self.alternatives.put(route_id, owner, (ordering, sizes))
        return route_id

    def release(self, route_id: str, owner: str | None = None) -> bool:
        """The routed request ended: its worker's in-flight load drops now. False if already gone.

        Raises:
            InvalidArgument: `route_id` is not the 32 hex digits a route answer carries.
        """
        if not isinstance(route_id, str) or not _ROUTE_ID.match(route_id):
            raise InvalidArgument("route_id must be the 32 lowercase hex digits a Route answer carried")
        f = self.flights.release(route_id, owner)
        self.metrics.route_releases.labels("released" if f else "unknown").inc()
        if f is not None:
            self.alternatives.pop(route_id)
            self.shadow.free(route_id, time.monotonic())
        return f is not None

    def move(self, route_id: str, worker: str, dp_rank: int, owner: str | None = None) -> bool:
        """The caller sent the routed request to another of its candidates (it skipped the chosen
        worker, or failed over from it): the request's in-flight load, its blocks in the block-pool
        shadow and its conversation's working-set record move there. Without this the router went on
        counting the request on a worker it never reached, and its shadow of the worker that did run
        it missed those blocks, so later routes trusted blocks that worker had evicted (stale WARM
        routes after a sleep behind the controller's back, issue #27). False (nothing moves) if the
        route is unknown, ended, another tenant's, or `worker`/`dp_rank` (serving) was not one of its candidates.
        The moved route counts from now, so a lifecycle verb on its new worker waits for it (Router._settle).

        Raises:
            InvalidArgument: a malformed `route_id`, `worker` or `dp_rank`.
            FailedPrecondition: the candidate is not serving now (asleep, paused, down, faulty, a verb in
                flight, or gone): the caller must not send the request there. NOTE: the proxy used to send
                its failover to a runner-up the controller had put to sleep since the route (its listing
                lags by up to --refresh), and the request waited there until the client gave up.
        """
        if not isinstance(route_id, str) or not _ROUTE_ID.match(route_id):
            raise InvalidArgument("route_id must be the 32 lowercase hex digits a Route answer carried")
        if not isinstance(worker, str) or not worker or isinstance(dp_rank, bool) or not isinstance(dp_rank, int):
            raise InvalidArgument("move_route needs the worker name and dp_rank of one of the route's candidates")
        alt = self.alternatives.get(route_id)
        f = self.flights.get(route_id)
        key = (worker, dp_rank)
        if alt is None or f is None or (owner is not None and f.owner is not None and f.owner != owner):
            return False
        v = w.view() if (w := self.workers.get(worker)) is not None else None
        if v is None or not v.has_rank(dp_rank) or not v.rank(dp_rank).serving:
            raise FailedPrecondition(f"worker {worker!r} rank {dp_rank} is not serving now (asleep, paused, down, "
                                     "faulty, a lifecycle verb in flight, or gone): send the request elsewhere")
        ordering, sizes = alt
        to = next((c for c in ordering.ordered if (c.state.worker, c.state.dp_rank) == key), None)
        if to is None or key == f.key:
            return False
        now = time.monotonic()
        self.flights.release(route_id, owner)
        self.shadow.free(route_id, now)
        placed = ordering.chains.get(key)
        self.flights.add(f._replace(key=key, num_tokens=to.terms.prefill_tokens, last_hash=ordering.last_hash.get(key),
                                    t=now, blocks=_blocks(placed)))
        if placed is not None:
            for part, (chain, _, _) in enumerate((placed, *ordering.batch.get(key, ()))):
                if chain:
                    self.demand.move(chain[-1], key)
                if worker in self.workers:
                    self._shadow_route(key, route_id, chain, sizes[part], now, owner, part)
        self.metrics.route_releases.labels("moved").inc()
        return True

    def _shadow_route(self, key: tuple[str, int], route_id: str, chain: list[int], num_tokens: int,
                      now: float, owner: str | None = None, part: int = 0) -> None:
        """Replay the route on the rank's block-pool shadow (controller.shadow_pool): the blocks LRU
        drops for it are known before their BlockRemoved arrives. An untracked route (it may never be sent,
        and its end is never told) leaves the pool as it is: only `owner`'s own Routes believe what it would
        evict. A tracked one is freed when released or dropped from the ledger; other tenants' Routes believe what
        it evicts while it may be on its way (shadow_pool.UNSENT_S), then once a BlockStored of its new blocks shows
        it sent, and if it ends before that, its admission is undone (track is the caller's choice: a tracked Route,
        never sent, used to hide every tenant's blocks for the 5 s grace). `part`: which prompt of a batch (0: the
        first), each its own request in the pool, all freed with the route."""
        w = self.workers[key[0]].view()
        B = w.hash_cfg.block_size if w.hash_cfg is not None else 0
        if not B:
            return
        self.shadow.allocate(key, route_id, chain, 1 if num_tokens % B else 0, self.pool_size(key), now,
                             None if route_id else owner or "", owner or "", part)

    def pool_size(self, key: tuple[str, int]) -> int | None:
        """The rank's num_gpu_blocks as its shadow is sized (/metrics, else learned from evictions). NOTE: one helper
        for routes and events: sized otherwise by either, the shadow would be rebuilt, empty, at each turn."""
        w = self.workers.get(key[0])
        return (w.load.num_gpu_blocks if w is not None else None) or self.index.learned_capacity(key)

    def expire(self) -> None:
        """Drop the tracked routes past the TTL (the hot path: most calls expire nothing)."""
        if expired := self.flights.expire(time.monotonic()):
            self.ended(expired, "ttl")

    def ended(self, flights: list[Flight], reason: str) -> None:
        """The ledger dropped these tracked routes (`reason`: ttl, reconcile, unregistered): their blocks leave the
        shadow and they can no longer move."""
        if flights:
            self.metrics.inflight_dropped.labels(reason).inc(len(flights))
        now = time.monotonic()
        for f in flights:
            self.shadow.free(f.route_id, now)
            self.alternatives.pop(f.route_id)

    async def settle(self, reconcile: Callable[[WorkerView, RankKey], None]) -> None:
        """Between routes too: expire and reconcile tracked routes, so routes a dead caller never released
        (a proxy SIGKILLed mid-request) leave the ledger once the worker's /metrics show them ended, not
        only when the next route happens to look at that worker."""
        if not self.flights:
            return
        self.expire()
        for w in list(self.workers.values()):
            v = w.view()
            for r in v.ranks:
                reconcile(v, (v.name, r.dp_rank))

    def inflight_rows(self) -> list[tuple[str, float, float]]:
        """(worker, tracked routes, their queued tokens) of every registered worker, for the scrape (Metrics.inflight)."""
        rows = []
        for name, w in list(self.workers.items()):
            loads = [self.flights.load((name, r)) for r in w.spec.dp_rank_ids]
            rows.append((name, float(sum(n for n, _, _ in loads)), float(sum(k for _, _, k in loads))))
        return rows

    def observe(self, num_tokens: int, t: RouteCost, cands: tuple[RouteCandidate, ...]) -> None:
        """Count a decision (`t`: its cost; `cands`: its candidates, cheapest first) in the route metrics."""
        m = self.metrics
        m.route_total.labels(verdict_of(t.cached_tokens)).inc()
        m.route_cost.observe(t.total)
        if len(cands) > 1 and cands[1].cost is not None:
            m.route_cost_margin.observe(cands[1].cost.total - t.total)
        self._routed += num_tokens
        self._matched += t.cached_tokens
        if self._routed:
            m.hit_rate.set(self._matched / self._routed)


def _blocks(placed: tuple[list[int], int, int] | None) -> tuple[int, ...]:
    """A route's leading block hashes on its rank, as the in-flight ledger credits them (InFlight.pending)."""
    return tuple(placed[0][:PENDING_BLOCKS]) if placed is not None else ()
