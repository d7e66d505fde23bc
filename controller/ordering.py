"""Ordering a prompt's serving candidates by cost (controller/cost.py, docs/routing.md).

The Router (controller/router.py) owns the workers and the request lifecycle; a CandidateOrder reads them: for
each serving (worker, rank) it gathers the cost's inputs (the prefix index's proven match, the in-flight
ledger reconciled against the worker's last /metrics look, the conversation working set) and asks
`cost.rank` for the order. Hashing a prompt's block chains is O(tokens), so `checked_chains` runs off the
event loop and hands `rank` its result; for a long prompt so do its `seed_of` and the Branches observations of
the chains `warm_keys` names (the router's hashing thread), and `order` takes them.
"""

from __future__ import annotations

import functools
import hashlib
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from controller import batch_route, cost
from controller.batch_route import Hashed, LaterPrompt
from controller.cost import CandidateState, CostConfig, Scored
from controller.demand import Conversation, DemandLedger
from controller.index import PrefixIndex, RankKey
from controller.inflight import Flight, InFlight
from controller.shadow import ShadowPools
from controller.tenant_branches import TenantBranches
from controller.view import WorkerView
from controller.vllm.watcher import Worker
from fleet.core.block_hash import external_chain
from fleet.core.errors import InvalidArgument, KvfleetError, NotFound, Unavailable

# NOTE: what a caller does about a model none of whose workers serves now (the proxy relays it as a 503): it said
# only "asleep, paused or down", which names no next step (found by a new user's OpenAI-client run)
AGAIN = "retry later; `kvfleet worker ls` shows each worker's phase"


class Ordering(NamedTuple):
    """The serving candidates, cheapest first, and what the router keeps of the prompt's chains."""

    ordered: list[Scored]
    last_hash: dict[RankKey, int | None]  # the prompt's last full block hash per proven rank
    chains: dict[RankKey, tuple[list[int], int, int]]  # per proven rank: the prompt's chain, its shared blocks, its group
    # per proven rank, a batch's later prompts as `chains` holds the first (controller/batch_route.py)
    batch: dict[RankKey, list[tuple[list[int], int, int]]] = {}


@functools.lru_cache(maxsize=4096)
def solo_group(owner: str | None) -> int:
    """The return-evidence group of `owner`'s conversations that continue no shared prefix. One group for
    every tenant (0, before) let one tenant's traffic set the rate at which everyone's such conversations are
    weighed: 200 tiny Routes of one-shots moved it from 0.00 to 0.94 (hardening round three)."""
    if owner is None:
        return 0
    return int.from_bytes(hashlib.blake2b(owner.encode(), digest_size=8, person=b"kvfleet-solo").digest(), "big")


class CandidateOrder:
    """The state routing reads, and the cost ordering over it. Single event loop, like the Router."""

    def __init__(
        self,
        workers: Mapping[str, Worker],
        index: PrefixIndex,
        flights: InFlight,
        demand: DemandLedger,
        branches: TenantBranches,
        cost_config: Callable[[], CostConfig],
        ended: Callable[[list[Flight], str], None],
        shadow: ShadowPools | None = None,
    ) -> None:
        """`workers` is the router's live registry (read, never changed here); `ended` is told of
        tracked routes the reconcile ends; `shadow` (controller.shadow) hides blocks it knows
        LRU dropped before their BlockRemoved arrived."""
        self.workers, self.index, self.flights, self.demand, self.branches = workers, index, flights, demand, branches
        self.shadow = shadow or ShadowPools()
        self.cost, self.ended = cost_config, ended
        self._looked: dict[RankKey, float] = {}  # the /metrics look each rank was last reconciled with

    def hash_jobs(self, model: str, lora: str | None) -> dict[Any, Any]:
        """The block-hash chains _rank will need, keyed as rank keys them (cheap; no hashing here)."""
        jobs: dict[Any, Any] = {}
        for w in self.workers.values():
            try:
                v = w.view()
                adapter = v.adapter(model, lora)
                if adapter is False:
                    continue
                if v.hash_cfg is not None and any(rv.serving for rv in v.ranks):
                    jobs[v.chain_key(adapter)] = (v.hash_cfg, v.lora_key(adapter))
            except Exception:  # NOTE: contained and counted once, by rank, which takes the same view
                continue
        return jobs

    def warm_keys(self, model: str, lora: str | None) -> list[Any]:
        """The chain keys whose chains `order` would observe in the Branches, in the order it would (cheap)."""
        keys: dict[Any, None] = {}
        for w in self.workers.values():
            try:
                v = w.view()
                adapter = v.adapter(model, lora)
                if adapter is False or v.hash_cfg is None:
                    continue
                if any(rv.serving and rv.warmable for rv in v.ranks):
                    keys[v.chain_key(adapter)] = None
            except Exception:  # NOTE: contained and counted once, by rank, which takes the same view
                continue
        return list(keys)

    def order(self, token_ids: Sequence[int], model: str, salt: str | None, lora: str | None,
              pre: dict[Any, list[int]] | None = None, seed: int | None = None,
              observed: dict[Any, int] | None = None, owner: str | None = None,
              batch: Sequence[Sequence[int]] = (), batch_pre: Sequence[Hashed] | None = None) -> Ordering:
        """Rank the candidates; `pre` holds chains hashed off the event loop (see checked_chains), `seed` the
        prompt's seed_of and `observed` what Branches.observe returned there for the chains of warm_keys; a chain
        or key missing from them (a worker that came or woke meanwhile) is hashed or observed here. `owner`, the
        tenant: a conversation with no shared prefix pools its return evidence with that tenant's alone. `batch`: a
        batched request's later prompts (`token_ids` is its first), `batch_pre` their work done off the loop; the
        candidates are then costed by the whole batch (controller/batch_route.py)."""
        # per hash config: the prompt's chain, and the tracked routes it extends
        chains: dict[Any, tuple[list[int], dict[RankKey, int], int, tuple[int, Conversation] | None]] = {}
        last: dict[RankKey, int | None] = {}
        placed: dict[RankKey, tuple[list[int], int, int]] = {}
        later: dict[Any, list[LaterPrompt]] = {}  # per hash config: the batch's later prompts
        placed_later: dict[RankKey, list[tuple[list[int], int, int]]] = {}
        later_shared = [0] * len(batch)  # per later prompt, as `shared`
        solo = solo_group(owner)
        self.demand.expire(time.monotonic())
        cfg = self.cost()
        # NOTE: the two shared-prefix terms' inputs are read only where the cost uses them (both a walk per candidate)
        use_pending, use_mixed = cfg.inflight_prefix, cfg.mixed_prefix_weight > cfg.shared_prefix_weight
        states = []
        shared = 0  # leading tokens other conversations share (a system prompt): amortized, not glue
        if seed is None:
            seed = seed_of(token_ids)
        for name, w in self.workers.items():
            try:
                v = w.view()
                adapter = v.adapter(model, lora)
                if adapter is False:
                    continue
                mine: list[CandidateState] = []
                for rv in (rv for rv in v.ranks if rv.serving):
                    key, chain, ext = (name, rv.dp_rank), None, None
                    proven = rv.warmable
                    if proven and v.hash_cfg is not None:
                        ck = v.chain_key(adapter)
                        hit = chains.get(ck)
                        if hit is None:
                            chain = (pre or {}).get(ck)
                            if chain is None:
                                chain = external_chain(v.hash_cfg, token_ids, lora=v.lora_key(adapter), cache_salt=salt)
                            nshared = (observed or {}).get(ck)
                            if nshared is None:
                                nshared = self.branches.observe(chain, owner)
                            prev = self.demand.previous(chain)
                            hit = chains[ck] = (chain, self.flights.extended(chain), nshared, prev)
                            shared = max(shared, nshared * v.hash_cfg.block_size)
                            if batch:
                                parts = later[ck] = batch_route.later_prompts(
                                    ck, v.hash_cfg, v.lora_key(adapter), batch, batch_pre, salt, self.branches,
                                    self.demand, owner)
                                later_shared = [max(a, p.num_shared * v.hash_cfg.block_size)
                                                for a, p in zip(later_shared, parts, strict=True)]
                        chain, ext, nshared, prev = hit
                        last[key] = chain[-1] if chain else None
                        group = chain[nshared - 1] if nshared else solo
                        placed[key] = (hit[0], nshared, group)
                        need = self.demand.demand_with(key, prev[1] if prev else None, len(hit[0]), nshared, group)
                        mixed = use_mixed and bool(nshared) and self.demand.serves_other_prefix(key, hit[0][0])
                        if batch:
                            parts = later[ck]
                            placed_later[key] = batch_route.placed(parts, solo)
                            need = batch_route.demand_with(self.demand, key, need, parts, solo)
                    else:
                        need, mixed = -1, False
                    s = self._state(v, key, proven, chain, ext, seed, need, owner or "", mixed, use_pending)
                    if batch and proven and v.hash_cfg is not None:
                        s = s._replace(batch_cached=batch_route.cached_tokens(
                            self.index, self.shadow, key, later[v.chain_key(adapter)], v.hash_cfg.block_size,
                            owner or ""))
                    mine.append(s)
            except Exception as e:  # one worker's bad state costs that worker its candidacy, no more
                w.errors.failed("route", e)
                continue
            states += mine
        sizes = [(len(ids), n) for ids, n in zip(batch, later_shared, strict=True)]
        ranked = cost.order(cfg, len(token_ids), states, cfg.untracked_request_tokens, shared, sizes)
        return Ordering(ranked, last, placed, placed_later)

    def _state(
        self,
        w: WorkerView,
        key: RankKey,
        proven: bool,
        chain: list[int] | None,
        extended: dict[RankKey, int] | None,
        seed: int,
        demand_blocks: int = -1,
        owner: str = "",
        mixed: bool = False,
        use_pending: bool = True,
    ) -> CandidateState:
        """One candidate's inputs to the cost: index, in-flight ledger (reconciled), last /metrics look (of the
        rank's own engine: engine 0's load was charged to every rank)."""
        m = w.rank_load(key[1])
        n = nq = toks = 0
        if self.flights:  # NOTE: nothing to reconcile or count while no route is tracked (the common case)
            self.reconcile(w, key)
            n, nq, toks = self.flights.load(key)
            if nq and extended:
                toks -= extended.get(key, 0)
        B = w.hash_cfg.block_size if w.hash_cfg is not None else 0
        matched, resident, learned = self.index.residency(key, chain)
        if matched and chain:
            matched = self.shadow.resident_prefix(key, chain, matched, time.monotonic(), owner)
        pending = self.flights.pending(key, chain) if use_pending and n and chain else 0
        return CandidateState(
            key[0],
            key[1],
            True,
            proven,
            B,
            matched * B,
            n,
            nq,
            toks,
            m.running,
            m.waiting,
            resident,
            m.num_gpu_blocks or learned,
            m.kv_usage,
            zlib.crc32(key[0].encode(), seed),
            demand_blocks,
            self.flights.mean_tokens(key),
            num_pending_tokens=pending * B,
            serves_other_prefix=mixed,
        )

    def none_serving(self, model: str, lora: str | None) -> KvfleetError:
        """Why `order` found no candidate for `model` (and `lora`). NotFound when no registered worker serves it at all
        (a typo, or a model never registered: a retry cannot help, and the SDK retries only Unavailable); Unavailable
        when some do but none is serving now (asleep, paused or down, which a retry may outlive).

        NOTE: a route for an unknown model was Unavailable, so the SDK retried it 8 times over 9 s and then told
        the caller to check that the controller was running (found by review).
        """
        served: dict[str, None] = {}
        for w in self.workers.values():
            try:
                v = w.view()
            except Exception:  # NOTE: a worker we cannot read may serve it: not a NotFound
                return Unavailable(f"no serving worker for model {model!r}; a worker's state could not be read ({AGAIN})")
            if v.adapter(model, lora) is not False:
                return Unavailable(f"no serving worker for model {model!r}; every candidate is asleep, paused or down "
                                   f"({AGAIN})")
            served[v.model] = None
            served.update(dict.fromkeys(f"{name} (LoRA of {v.model})" for name in sorted(v.loras)))
        what = f"model {model!r}" + (f" with LoRA {lora!r}" if lora else "")
        known = f"registered models: {', '.join(sorted(served))}" if served else "no worker is registered"
        return NotFound(f"no registered worker serves {what} ({known})")

    def drop_worker(self, worker: str) -> None:
        """The worker was unregistered: forget the looks its ranks were reconciled with. NOTE: kept, one entry per
        rank of every worker ever routed to stayed for the controller's life (a fleet whose pods register under new
        names grew it by each pod)."""
        for key in [key for key in self._looked if key[0] == worker]:
            del self._looked[key]

    def reconcile(self, w: WorkerView, key: RankKey) -> None:
        """Fold the worker's newest /metrics look into the in-flight ledger, once per look."""
        if len(w.ranks) == 1 and w.load_at is not None and self._looked.get(key) != w.load_at:
            # NOTE: one-rank workers only: the proxy does not pin a DP rank (vLLM's X-data-parallel-rank), so the
            # engine its API server picks may not be the rank a route is counted on, and that rank's count cannot end it
            self._looked[key] = w.load_at
            self.ended(self.flights.reconcile(key, w.load.running, w.load.waiting, w.load_at), "reconcile")


def seed_of(token_ids: Sequence[int]) -> int:
    """The candidates' tie-break seed: a hash of the whole prompt, not a shared head. O(tokens)."""
    return hash(tuple(token_ids)) & 0xFFFFFFFF


def checked_chains(jobs: dict[Any, Any], token_ids: Sequence[int], model: str, salt: str | None,
                    lora: str | None) -> dict[Any, list[int]]:
    """Check a prompt's tokens, then hash its block chains. Pure: both are O(tokens) (about 0.2 s and 1 s per
    million tokens), so the router runs a long prompt's in a thread (hash_lane.INLINE_HASH_TOKENS)."""
    check_route_args(token_ids, model, salt, lora)
    return {ck: external_chain(cfg, token_ids, lora=lk, cache_salt=salt) for ck, (cfg, lk) in jobs.items()}


def check_route_args(token_ids: Sequence[int], model: str, salt: str | None, lora: str | None) -> None:
    if not isinstance(model, str) or not model:
        raise InvalidArgument("route needs a model name")
    if (
        not isinstance(token_ids, list | tuple)
        or not set(map(type, token_ids)) <= {int}
        or (token_ids and min(token_ids) < 0)
    ):
        raise InvalidArgument("token_ids must be a list of non-negative ints")
    if salt is not None and not isinstance(salt, str):
        raise InvalidArgument("cache_salt must be a string")
    if lora is not None and (not isinstance(lora, str) or not lora):
        raise InvalidArgument("lora must be a non-empty adapter name")
