"""Typed results of the SDK (frozen dataclasses), built from the kvfleet.v1 messages."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fleet.cas.types import BlobMeta
from fleet.core.route_types import RouteCandidate as RouteCandidate  # the SDK returns the core types
from fleet.core.route_types import RouteCost as RouteCost
from fleet.core.route_types import RouteDecision as RouteDecision


@dataclass(frozen=True, slots=True)
class BlobRef:
    """A stored blob: `ref` is the SHA-256 hex of its bytes. `str(ref)` is the hex."""

    ref: str
    size: int

    def __str__(self) -> str:
        return self.ref


BlobInfo = BlobMeta  # what get_blob_info / stat return: the store's own record (fleet/cas/types.py)


@dataclass(frozen=True, slots=True)
class Witness:
    """A lifecycle action's cache-loss witness (DESIGN §9). kv: "preserved" | "forgotten" | "unknown"."""

    worker: str
    action: str
    phase: str
    kv: str
    warm_demoted: bool
    serving: bool
    epoch: int


@dataclass(frozen=True, slots=True)
class RankInfo:
    """One (worker, dp_rank): serving and warm are separate questions (DESIGN §9)."""

    dp_rank: int
    epoch: int
    serving: bool
    phase: str
    kv: str
    num_blocks: int
    last_seq: int
    warm: bool
    load: float
    kv_usage: float
    fence: str


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    name: str
    url: str
    kv_events: str
    replay: str
    model: str
    dp_ranks: int
    block_size: int | None
    hash_algo: str
    hash_seed: str | None
    ranks: tuple[RankInfo, ...] = ()
    dp_rank_start: int = 0  # the first global DP rank (ranks[i].dp_rank = dp_rank_start + i)

    @property
    def serving(self) -> bool:
        return any(r.serving for r in self.ranks)

    @property
    def draining(self) -> bool:
        """A pause with mode=wait of the controller is running on it: not serving, but the requests already there
        finish there (phase "draining"; vLLM's verbs act on every rank at once)."""
        return any(r.phase == "draining" for r in self.ranks)


@dataclass(frozen=True, slots=True)
class Caller:
    """What the controller says the presented token is."""

    tenant: str
    role: str
    name: str


@dataclass(frozen=True, slots=True)
class FleetInfo:
    controller_version: str
    store: str
    leader: bool
    workers: tuple[WorkerInfo, ...]


def blob_info(m: Any) -> BlobInfo:
    return BlobInfo(m.ref, m.size, m.created, m.pins, m.refs, m.verdict, tuple(m.reasons), m.lease_expires)


def route_cost(m: Any) -> RouteCost:
    return RouteCost(
        m.total,
        m.prefill_tokens,
        m.cached_tokens,
        m.queued_tokens,
        m.active_requests,
        m.evicted_tokens,
        m.amortized_tokens,
    )


def route_candidate(c: Any) -> RouteCandidate:
    return RouteCandidate(
        c.worker, c.dp_rank, c.matched_tokens, route_cost(c.cost) if c.HasField("cost") else None
    )


def route_decision(r: Any) -> RouteDecision:
    cands = tuple(route_candidate(c) for c in r.candidates)
    return RouteDecision(
        r.worker,
        r.url,
        r.dp_rank,
        r.verdict,
        r.matched_tokens,
        r.epoch,
        r.cache_salt,
        cands,
        r.route_id,
        route_cost(r.cost) if r.HasField("cost") else None,
        route_candidate(r.runner_up) if r.HasField("runner_up") else None,
    )


def witness(r: Any) -> Witness:
    w = r.witness
    return Witness(r.worker, w.action, w.phase, w.kv, w.warm_demoted, w.serving, w.epoch)


def worker_info(s: Any) -> WorkerInfo:
    p = s.spec
    ranks = tuple(
        RankInfo(
            r.dp_rank,
            r.epoch,
            r.serving,
            r.phase,
            r.kv,
            r.num_blocks,
            r.last_seq,
            r.warm,
            r.load,
            r.kv_usage,
            r.fence,
        )
        for r in s.ranks
    )
    return WorkerInfo(
        p.name,
        p.url,
        p.kv_events,
        p.replay,
        p.model,
        p.dp_ranks,
        p.block_size or None,
        p.hash_algo,
        p.hash_seed if p.HasField("hash_seed") else None,
        ranks,
        p.dp_rank_start,
    )


def fleet_info(r: Any) -> FleetInfo:
    return FleetInfo(r.controller_version, r.store, r.leader, tuple(worker_info(w) for w in r.workers))
