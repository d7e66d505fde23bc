"""Placement by cost: what one request costs on each serving candidate, in prefill-token units.

Pure: no I/O, no clock of its own (callers pass `now`). The router builds one `CandidateState` per
serving (worker, dp_rank) from its index, its in-flight ledger (controller/inflight.py) and the last
/metrics look, and `order` orders them; docs/routing.md gives the reasoning and how llm-d, Dynamo and
SGLang compare.

    cost(w) = prefill(w) - (1 - share(w)) * amortized(w)
              + queue_weight * queued(w) + request_weight * active(w) + pressure_weight * evicted(w)
    share(w) = max(shared_prefix_weight, mixed_prefix_weight) where w serves conversations of another first
               block (another system prompt or tenant), else shared_prefix_weight

    prompt      |<------------------------- num_prompt_tokens ------------------------->|
    on w        |<--- cached: proven warm under the current epoch --->|<-- prefill(w) -->|
    in flight   |<--- pending: in the prompts of tracked routes on w not yet ended --->|   (inflight_prefix:
                prefill(w) is what neither covers, as vLLM finds both cached at admission)

    amortized(w) the part of prefill(w) that is a prefix other conversations share (a system
                prompt: a block seen followed by two different blocks): each worker pays it once
                for every conversation it will host, so it does not glue new ones to its holder
    queued(w)   prefill tokens waiting ahead on w: tracked routes vLLM has not scheduled yet, plus
                requests in vllm:num_requests_waiting beyond those, each at the mean size of the tracked
                routes w was seen to schedule (InFlight.mean_tokens: per rank, never moved by routes
                that did not run there)
    active(w)   requests on w: tracked routes not yet ended, or /metrics' running + waiting if more
    evicted(w)  tokens of other prefixes that the new blocks push out of w's GPU cache: the
                rank's working set over its capacity (controller.demand, weighted by return
                rates); without one, max(0, occupied + new blocks - capacity) blocks; without a
                capacity, the share of the new blocks that kv_cache_usage_perc above
                `kv_high_water` implies. 0 when every full block of the prompt is resident on w:
                a request that adds no block evicts nothing

A batch (one request, several prompts: a completions `prompt` list) is costed by the same terms, its cached,
prefill and amortized tokens summed over its prompts (`terms(batch=...)`, controller/batch_route.py).

Hard rules stay outside the arithmetic: a candidate that is not serving is never ranked, and one
that is not proven (epoch, calibration, fences) gets no cached tokens, whatever it would cost.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from fleet.core.errors import InvalidArgument
from fleet.core.route_types import RouteCost


@dataclass(frozen=True, slots=True)
class CostConfig:
    """Weights of the cost, in prefill tokens per unit (defaults reasoned in docs/routing.md).

    Args:
        queue_weight: cost of one prefill token waiting ahead on a worker. 0.25: a token recomputed
            elsewhere is paid at least twice (this request's wait and the work every later request
            there waits behind), a queued token once and only until the queue drains; a warm request
            moves when the gap in queued tokens exceeds four times its warm prefix (0.5 before round
            twenty-one: docs/routing.md says what the change measured).
        request_weight: cost of one more active request on a worker (decode batch slot and a token
            of every step's budget), in tokens. 16: small next to any prefill, it spreads equal
            prefill costs by load.
        pressure_weight: cost of one token of another prefix evicted. 1.0: in an agent fleet the
            evicted history comes back and is prefilled again.
        shared_prefix_weight: share of a missing shared prefix (a system prompt) that counts. 0:
            a worker prefills it once and then hosts every later conversation with it, so a new
            conversation is placed by load and room, not glued to whoever holds the prompt.
        kv_high_water: without a known capacity, KV usage above this share counts as eviction.
        untracked_request_tokens: the size assumed for a request /metrics shows on a rank but the router
            did not track, until a look has seen that rank schedule tracked routes (then their running
            mean there is used: InFlight.mean_tokens).
        inflight_ttl_s: a tracked route not released within this long stops counting (a leak bound).
        working_set_ttl_s: a conversation with no turn for this long leaves its rank's working set
            (controller.demand); 600 s: agents pause for tools and people, a closed one must decay.
        reconcile_grace_s: a route older than this at a /metrics look has reached the worker; the
            look's waiting and running counts then tell which tracked routes were scheduled or ended.
        affinity_margin: how much cheaper, in tokens, another candidate must be before a conversation
            leaves the candidate holding its own history (`with_affinity`). 0 (off): measured on the
            routing bench, 128 stopped short chats from crossing between equally loaded workers, but
            with sleeps and resets behind the router's back it was a wash, and it kept sessions on a
            slept worker longer (docs/routing.md, "Affinity margin: tried, opt-in").
        mixed_prefix_weight: share of a missing shared prefix that counts on a rank serving conversations of
            another first block (another system prompt or tenant; the larger of this and shared_prefix_weight):
            a rank that serves one tenant's system prompt takes another's only when it is cheaper by that much.
            0: as anywhere else.
        scheduled_by_events: a tracked route leaves its rank's queue when a BlockStored event of that rank carries its
            prompt's last full block (vLLM stores it in the step that schedules the prompt: InFlight.scheduled); off
            (the default), only a /metrics look at least `reconcile_grace_s` after the route, or its release, takes it
            out. Off: on the routing bench the truer queue prefilled 11% more in agents16x4/very-tight and 4.6% less
            in tenants2, a wash elsewhere (docs/routing.md, "Queued until seen scheduled: tried, opt-in").
        inflight_prefix: a prompt prefix that tracked routes not yet ended are computing on a rank counts as
            cached there (InFlight.pending), as vLLM will find it at admission; off, only KV events prove it.
    """

    queue_weight: float = 0.25
    request_weight: float = 16.0
    pressure_weight: float = 1.0
    shared_prefix_weight: float = 0.0
    kv_high_water: float = 0.8
    untracked_request_tokens: int = 256
    inflight_ttl_s: float = 120.0
    working_set_ttl_s: float = 600.0
    reconcile_grace_s: float = 0.25
    affinity_margin: float = 0.0
    inflight_prefix: bool = True
    mixed_prefix_weight: float = 0.5
    scheduled_by_events: bool = False

    def __post_init__(self) -> None:
        for name in ("shared_prefix_weight", "mixed_prefix_weight"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v <= 1:
                raise InvalidArgument(f"{name} must be in [0, 1], got {v!r}")
        for name in ("queue_weight", "request_weight", "pressure_weight", "reconcile_grace_s", "affinity_margin"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
                raise InvalidArgument(f"{name} must be a finite number >= 0, got {v!r}")
        for name in ("inflight_prefix", "scheduled_by_events"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidArgument(f"{name} must be true or false, got {getattr(self, name)!r}")
        if (
            isinstance(self.kv_high_water, bool)
            or not isinstance(self.kv_high_water, int | float)
            or not 0 <= self.kv_high_water < 1
        ):
            raise InvalidArgument(f"kv_high_water must be in [0, 1), got {self.kv_high_water!r}")
        for name in ("inflight_ttl_s", "working_set_ttl_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not 0 < v < math.inf:
                raise InvalidArgument(f"{name} must be a positive number of seconds, got {v!r}")
        if (
            isinstance(self.untracked_request_tokens, bool)
            or not isinstance(self.untracked_request_tokens, int)
            or self.untracked_request_tokens < 0
        ):
            raise InvalidArgument(
                f"untracked_request_tokens must be an int >= 0, got {self.untracked_request_tokens!r}"
            )


class CandidateState(NamedTuple):
    """What the router knows about one (worker, dp_rank) when a request arrives."""

    worker: str
    dp_rank: int
    serving: bool
    proven: bool  # warm-able: serving, calibrated, current epoch, no fence; else cached tokens count 0
    block_size: int  # 0 when unknown (no pressure estimate then)
    num_cached_tokens: int
    num_inflight_requests: int = 0  # tracked routes not yet ended
    num_queued_requests: int = 0  # of those, not yet scheduled by vLLM
    num_queued_tokens: int = 0  # their prefill tokens (less routes this prompt extends: Router)
    num_running: float = 0.0  # vllm:num_requests_running at the last look
    num_waiting: float = 0.0  # vllm:num_requests_waiting at the last look
    num_resident_blocks: int = 0  # GPU blocks the index holds for the rank
    num_gpu_blocks: int | None = None  # capacity: vllm:cache_config_info, or learned from evictions
    kv_usage: float = 0.0  # vllm:kv_cache_usage_perc
    spread: int = 0  # tie-break hash (prompt x worker)
    # the rank's working set with this request placed there (controller.demand), -1 when unknown
    num_demand_blocks: int = -1
    # the size a waiting request the router did not track counts at on this rank (InFlight.mean_tokens);
    # None: the `mean_request_tokens` the caller of `terms` passes
    mean_request_tokens: float | None = None
    # a batch's later prompts (controller/batch_route.py): the proven-warm prefix of each here, in the batch's order
    batch_cached: tuple[int, ...] = ()
    # the prompt's leading tokens that tracked routes on the rank, not yet ended, have in their prompts
    # (InFlight.pending): cached when this request is admitted, whether KV events have proven them yet or not
    num_pending_tokens: int = 0
    # the rank serves conversations of another first block than this request's: another system prompt or tenant
    # (DemandLedger.serves_other_prefix)
    serves_other_prefix: bool = False


class Scored(NamedTuple):
    terms: RouteCost
    state: CandidateState


def evicted_tokens(cfg: CostConfig, num_prefill_tokens: int, s: CandidateState) -> int:
    """Tokens of other prefixes the request's new blocks would evict on the candidate."""
    B = s.block_size
    if B <= 0 or num_prefill_tokens <= 0:
        return 0
    new_blocks = -(-num_prefill_tokens // B)
    if s.num_gpu_blocks:
        occupied = max(s.num_resident_blocks, math.ceil(s.kv_usage * s.num_gpu_blocks))
        return max(0, min(occupied + new_blocks - s.num_gpu_blocks, new_blocks)) * B
    share = min(1.0, max(0.0, (s.kv_usage - cfg.kv_high_water) / (1.0 - cfg.kv_high_water)))
    return round(new_blocks * share) * B


def overcommit_tokens(s: CandidateState) -> int:
    """Tokens by which the rank's working set, this request included, exceeds its KV capacity.

    With vLLM's LRU (tail blocks first) a rank whose recent conversations need more blocks than it
    has evicts, every round, the blocks the next turns will ask for, so the excess is prefilled
    again round after round; a request placed on a rank with room pays its prefill once. Counting
    the whole excess (not just this request's new blocks) makes conversations leave an
    over-committed rank for one with room until the working sets fit (docs/routing.md).
    """
    assert s.num_gpu_blocks
    return max(0, s.num_demand_blocks - s.num_gpu_blocks) * s.block_size


def terms(
    cfg: CostConfig,
    num_prompt_tokens: int,
    s: CandidateState,
    mean_request_tokens: float,
    num_shared_tokens: int = 0,
    batch: Sequence[tuple[int, int]] = (),
) -> RouteCost:
    """The cost of sending a `num_prompt_tokens` request to the candidate, term by term.

    `num_shared_tokens`: the request's leading tokens that other conversations share (`Branches`,
    controller/branches.py).
    `mean_request_tokens`: the size of an untracked waiting request where the state names none.
    `batch`: a batched request's later prompts, each (num_prompt_tokens, num_shared_tokens); their cached prefixes
    here are `s.batch_cached`. The batch is one request to the worker that runs each prompt with its own prefix-cache
    hit, so its cached, prefill and amortized tokens are the sums over its prompts; it evicts nothing only if each
    prompt's full blocks are all resident.
    """
    _, _, _, proven, _, cached, n_active, n_queued, tracked, running, waiting, _, capacity, kv_usage = s[:14]
    cached = min(cached, num_prompt_tokens) if proven else 0
    # what it will find cached: the proven prefix, or more where routes in flight there compute more of it
    found = max(cached, min(s.num_pending_tokens, num_prompt_tokens)) if proven and cfg.inflight_prefix else cached
    prefill = num_prompt_tokens - found
    amortized = max(0, min(num_shared_tokens, num_prompt_tokens) - found)
    resident = s.block_size > 0 and num_prompt_tokens // s.block_size <= found // s.block_size
    if batch:
        for (n, shared), c in zip(batch, s.batch_cached or (0,) * len(batch), strict=True):
            c = min(c, n) if proven else 0
            cached, prefill, amortized = cached + c, prefill + n - c, amortized + max(0, min(shared, n) - c)
            resident = resident and n // s.block_size <= c // s.block_size
    queued = float(tracked)
    if waiting > n_queued:  # waiting requests /metrics shows beyond the ones we track, at the mean size
        mean = s.mean_request_tokens
        queued += (waiting - n_queued) * (mean_request_tokens if mean is None else mean)
    active = max(n_active, running + waiting)
    # NOTE: the fast path skips the block arithmetic where nothing can be evicted
    if resident:
        evicted = 0  # every full block is resident there: it adds none, so it evicts none (issue #27)
    elif s.num_demand_blocks >= 0 and capacity and s.block_size > 0:
        # NOTE: the working set over capacity, not only this request's new blocks: on an
        # over-committed rank LRU evicts what the next turns need, every round (see overcommit)
        evicted = overcommit_tokens(s)
    else:
        pressured = prefill > 0 and (capacity or kv_usage > cfg.kv_high_water)
        evicted = evicted_tokens(cfg, prefill, s) if pressured else 0
    share = max(cfg.shared_prefix_weight, cfg.mixed_prefix_weight) if s.serves_other_prefix else cfg.shared_prefix_weight
    total = (
        prefill
        - (1.0 - share) * amortized
        + cfg.queue_weight * queued
        + cfg.request_weight * active
        + cfg.pressure_weight * evicted
    )
    return RouteCost(total, prefill, cached, queued, active, evicted, amortized)


def order(
    cfg: CostConfig,
    num_prompt_tokens: int,
    states: Iterable[CandidateState],
    mean_request_tokens: float,
    num_shared_tokens: int = 0,
    batch: Sequence[tuple[int, int]] = (),
) -> list[Scored]:
    """Serving candidates, cheapest first.

    Ties (equal cost) go to the rank holding fewer resident blocks (more room: SGLang's "smallest
    tree" rule for cold requests), then by `spread`, a hash of the whole prompt and the worker, so
    sessions that share only a system prompt do not all tie-break the same way. Then the holder of
    the conversation's own history keeps it within `cfg.affinity_margin` (`with_affinity`).
    """
    keyed = []
    for i, s in enumerate(states):
        worker, dp_rank, serving = s[0], s[1], s[2]
        if serving:
            t = terms(cfg, num_prompt_tokens, s, mean_request_tokens, num_shared_tokens, batch)
            keyed.append((t[0], s.num_resident_blocks, s.spread, worker, dp_rank, i, t, s))
    keyed.sort()
    return with_affinity(cfg.affinity_margin, [Scored(k[6], k[7]) for k in keyed], num_shared_tokens)


def with_affinity(margin: float, ranked: list[Scored], num_shared_tokens: int = 0) -> list[Scored]:
    """Hysteresis: the candidate holding most of the conversation's own history keeps it unless another
    is cheaper by `margin` or more, or runs at most two thirds of its requests less one.

    Its own history is the cached tokens beyond the shared prefix (`num_shared_tokens`): a system
    prompt alone earns no affinity, so new conversations are still placed by load and room. The
    holder is the cheapest candidate with the most cached tokens; when it keeps the request it moves
    to the front and the others keep their order.

    A worker running far fewer requests is a lasting imbalance, which the margin does not hold.

    Why: the load terms are a snapshot, and in short chats on equally loaded workers a conversation with
    a short own history left whenever another worker's queue was a few hundred tokens shorter, paying
    that history's prefill again; two such moves often crossed. Off by default: with sleeps and resets
    behind the router's back it was a wash (docs/routing.md, "Affinity margin: tried, opt-in").
    """
    if margin <= 0 or len(ranked) < 2:
        return ranked
    top = max(c.terms.cached_tokens for c in ranked)
    if top <= num_shared_tokens or top <= ranked[0].terms.cached_tokens:
        return ranked
    i = next(i for i, c in enumerate(ranked) if c.terms.cached_tokens == top)
    holder, cheapest = ranked[i].terms, ranked[0].terms
    if holder.total - cheapest.total >= margin:
        return ranked
    if cheapest.active_requests <= (holder.active_requests - 1) * 2 / 3:
        return ranked  # NOTE: a lasting imbalance (far fewer requests there), not a passing queue
    return [ranked[i], *ranked[:i], *ranked[i + 1 :]]
