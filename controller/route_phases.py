"""The phases of a route (controller/router.py's Router takes these as a mixin; `Router.route` runs them in order).

1. `_ordered`: hash the prompts and order the candidates (controller/ordering.py): on the event loop up to
   INLINE_HASH_TOKENS in all, longer in a hashing thread (controller/hash_lane.py).
2. `_looked_at`: with a probe, the choice is probed and fails over on a bad answer (`_probe`); where no candidate
   serves because no worker lists the route's adapter (NotFound), the workers look at their adapters again
   (`_looked_again`), at most once every LORA_MISS_LOOK_S per worker, and the candidates are ordered again.
3. The placement is recorded by the RouteBook (controller/route_book.py).
4. `_decision`: the answer for the cheapest candidate, every candidate listed, counted in the metrics.

These share the Router's parts: its live `_workers`, candidate ordering, hashing lane, RouteBook, configuration and
metrics. Single event loop, like the Router.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence, Sized
from typing import TYPE_CHECKING

from controller.batch_route import Hashed
from controller.hash_lane import INLINE_HASH_TOKENS, HashLane
from controller.metrics import Metrics
from controller.ordering import CandidateOrder, Ordering, checked_chains
from controller.route_book import RouteBook
from controller.vllm.watcher import Worker
from fleet.core.errors import NotFound
from fleet.core.route_types import RouteCandidate, RouteDecision, verdict_of

if TYPE_CHECKING:
    from controller.router import RouterConfig

LORA_MISS_LOOK_S = 0.5  # a route for an adapter (or model) no worker lists looks again at most this often per worker


class RoutePhases:
    """`Router.route`'s phases 1, 2 and 4: order, probe or look again, decide."""

    cfg: RouterConfig
    metrics: Metrics
    candidates: CandidateOrder
    hash_lane: HashLane
    book: RouteBook
    _workers: dict[str, Worker]

    async def _ordered(
        self, token_ids: Sequence[int], model: str, salt: str | None, lora: str | None, owner: str | None,
        batch: Sequence[Sequence[int]],
    ) -> tuple[Ordering, Sequence[int], Sequence[Sequence[int]]]:
        """Phase 1 of `route`: the candidates in order, and the prompt's and batch's ids as ordered. Hashed here, on
        the event loop, up to INLINE_HASH_TOKENS in all; longer, in a hashing thread (HashLane.ordered)."""
        num_tokens = sum(len(p) if isinstance(p, Sized) else INLINE_HASH_TOKENS + 1 for p in (token_ids, *batch))
        if not all(isinstance(p, list | tuple) for p in (token_ids, *batch)) or num_tokens > INLINE_HASH_TOKENS:
            return await self.hash_lane.ordered(token_ids, model, salt, lora, owner, batch, num_tokens)
        async with self.hash_lane.inline_turn(owner, num_tokens):  # one such route of the tenant's at a time
            jobs = self.candidates.hash_jobs(model, lora)
            pre = checked_chains(jobs, token_ids, model, salt, lora)
            bpre = [Hashed(checked_chains(jobs, p, model, salt, lora), {}) for p in batch]
            ordering = self.candidates.order(token_ids, model, salt, lora, pre, owner=owner, batch=batch,
                                             batch_pre=bpre)
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
                await asyncio.gather(*(w.look() for w in self._workers.values()))
                ordering = self.candidates.order(token_ids, model, salt, lora, owner=owner, batch=batch)
            ordering = await self._probe(ordering, token_ids, model, salt, lora, owner, batch)
        if not ordering.ordered and await self._looked_again(model, lora):
            ordering = self.candidates.order(token_ids, model, salt, lora, owner=owner, batch=batch)
        if not ordering.ordered:
            raise self.candidates.none_serving(model, lora)
        return ordering


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
