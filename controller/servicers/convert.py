"""controller.router's domain objects <-> kvfleet.v1 messages."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from fleet.api.kvfleet.v1 import route_pb2, workers_pb2

if TYPE_CHECKING:
    from controller.router import WorkerSpec, WorkerStatus
    from fleet.core.lifecycle import Witness
    from fleet.core.route_types import RouteCandidate, RouteCost, RouteDecision


def spec_from_proto(p: workers_pb2.WorkerSpec) -> WorkerSpec:
    """Proto -> WorkerSpec; zero values mean the router's defaults. WorkerSpec validates (InvalidArgument)."""
    from controller.router import WorkerSpec

    return WorkerSpec(
        name=p.name,
        url=p.url,
        kv_events=p.kv_events,
        replay=p.replay or None,
        model=p.model,
        dp_ranks=p.dp_ranks or 1,
        block_size=p.block_size or None,
        hash_algo=p.hash_algo or None,  # empty: read it from the worker
        hash_seed=p.hash_seed if p.HasField("hash_seed") else None,
        dp_rank_start=p.dp_rank_start,
    )


def spec_to_proto(s: WorkerSpec) -> workers_pb2.WorkerSpec:
    out = workers_pb2.WorkerSpec(
        name=s.name,
        url=s.url,
        kv_events=s.kv_events,
        replay=s.replay or "",
        model=s.model,
        dp_ranks=s.dp_ranks,
        block_size=s.block_size or 0,
        hash_algo=s.hash_algo or "",
        dp_rank_start=s.dp_rank_start,
    )
    if s.hash_seed is not None:
        out.hash_seed = str(s.hash_seed)
    return out


def rank_to_proto(s: WorkerStatus) -> workers_pb2.RankStatus:
    return workers_pb2.RankStatus(
        dp_rank=s.dp_rank,
        epoch=s.epoch,
        serving=s.serving,
        phase=s.phase,
        kv=s.kv,
        num_blocks=s.num_blocks,
        last_seq=s.last_seq,
        warm=s.warm,
        load=s.load,
        kv_usage=s.kv_usage,
        fence=s.fence,
    )


def statuses_to_proto(statuses: Iterable[WorkerStatus]) -> list[workers_pb2.WorkerStatus]:
    """The router lists one WorkerStatus per (worker, dp_rank); the wire groups them per worker."""
    by_name: dict[str, workers_pb2.WorkerStatus] = {}
    for s in statuses:
        if s.name not in by_name:
            by_name[s.name] = workers_pb2.WorkerStatus(spec=spec_to_proto(s.spec))
        by_name[s.name].ranks.append(rank_to_proto(s))
    return list(by_name.values())


def witness_to_proto(w: Witness) -> workers_pb2.Witness:
    return workers_pb2.Witness(
        action=w.action, phase=w.phase, kv=w.kv, warm_demoted=w.warm_demoted, serving=w.serving, epoch=w.epoch
    )


def cost_to_proto(t: RouteCost | None) -> route_pb2.RouteCost | None:
    if t is None:
        return None
    return route_pb2.RouteCost(
        total=t.total,
        prefill_tokens=t.prefill_tokens,
        cached_tokens=t.cached_tokens,
        queued_tokens=t.queued_tokens,
        active_requests=t.active_requests,
        evicted_tokens=t.evicted_tokens,
        amortized_tokens=t.amortized_tokens,
    )


def candidate_to_proto(c: RouteCandidate) -> route_pb2.RouteCandidate:
    return route_pb2.RouteCandidate(
        worker=c.worker, dp_rank=c.dp_rank, matched_tokens=c.matched_tokens, cost=cost_to_proto(c.cost)
    )


def decision_to_proto(d: RouteDecision) -> route_pb2.RouteResponse:
    out = route_pb2.RouteResponse(
        worker=d.worker,
        url=d.url,
        dp_rank=d.dp_rank,
        verdict=d.verdict,
        matched_tokens=d.matched_tokens,
        epoch=d.epoch,
        candidates=[candidate_to_proto(c) for c in d.candidates],
        cache_salt=d.cache_salt,
        cost=cost_to_proto(d.cost),
        route_id=d.route_id,
    )
    if d.runner_up is not None:
        out.runner_up.CopyFrom(candidate_to_proto(d.runner_up))
    return out
