"""Router domain objects <-> proto messages (controller.router's WorkerSpec/WorkerStatus/Witness/RouteDecision)."""

from __future__ import annotations

import dataclasses
from typing import Any

from fleet.api.kvfleet.v1 import route_pb2, workers_pb2

_SPEC_FIELDS = ("name", "url", "kv_events", "replay", "model", "dp_ranks", "block_size", "hash_algo", "hash_seed")
_RANK_FIELDS = ("dp_rank", "epoch", "serving", "phase", "kv", "num_blocks", "last_seq")


def spec_from_proto(p: workers_pb2.WorkerSpec) -> Any:
    from controller.router import WorkerSpec

    seed: Any = p.hash_seed if p.HasField("hash_seed") else None
    return WorkerSpec(name=p.name, url=p.url, kv_events=p.kv_events, replay=p.replay, model=p.model,
                      dp_ranks=p.dp_ranks or 1, block_size=p.block_size or None,
                      hash_algo=p.hash_algo or "sha256", hash_seed=seed)


def spec_to_proto(s: Any) -> workers_pb2.WorkerSpec:
    out = workers_pb2.WorkerSpec(name=s.name, url=s.url or "", kv_events=s.kv_events or "", replay=s.replay or "",
                                 model=s.model or "", dp_ranks=int(s.dp_ranks or 1), block_size=int(s.block_size or 0),
                                 hash_algo=s.hash_algo or "")
    if getattr(s, "hash_seed", None) is not None:
        out.hash_seed = str(s.hash_seed)
    return out


def _fields(obj: Any) -> dict[str, Any]:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return dict(obj)
    return {k: v for k, v in vars(obj).items() if not k.startswith("_")}


def _rank_to_proto(r: Any) -> workers_pb2.RankStatus:
    f = _fields(r)
    return workers_pb2.RankStatus(dp_rank=int(f.get("dp_rank") or 0), epoch=int(f.get("epoch") or 0),
                                  serving=bool(f.get("serving")), phase=str(f.get("phase") or ""),
                                  kv=str(f.get("kv") or ""), num_blocks=int(f.get("num_blocks") or 0),
                                  last_seq=int(f["last_seq"]) if f.get("last_seq") is not None else -1)


def status_to_proto(st: Any) -> workers_pb2.WorkerStatus:
    """WorkerStatus -> proto: spec, per-rank state, and every other scalar field stringified in `extra`."""
    f = _fields(st)
    spec = f.pop("spec", None) or st
    ranks = f.pop("ranks", None) or []
    if isinstance(ranks, dict):
        ranks = list(ranks.values())
    extra = {k: str(v) for k, v in f.items() if k not in _SPEC_FIELDS and isinstance(v, (str, int, float, bool))}
    if not ranks and any(k in f for k in _RANK_FIELDS if k != "dp_rank"):
        ranks = [f]  # a flat single-rank status
    return workers_pb2.WorkerStatus(spec=spec_to_proto(spec), ranks=[_rank_to_proto(r) for r in ranks], extra=extra)


def witness_to_proto(w: Any) -> workers_pb2.Witness:
    return workers_pb2.Witness(action=str(w.action), phase=str(w.phase), kv=str(w.kv),
                               warm_demoted=bool(w.warm_demoted), serving=bool(w.serving), epoch=int(w.epoch or 0))


def _candidate(c: Any) -> route_pb2.RouteCandidate:
    if hasattr(c, "_asdict"):
        f = c._asdict()
    elif isinstance(c, tuple):
        f = dict(zip(("worker", "dp_rank", "matched_tokens"), c, strict=False))
    else:
        f = _fields(c)
    return route_pb2.RouteCandidate(worker=str(f.get("worker", "")), dp_rank=int(f.get("dp_rank") or 0),
                                    matched_tokens=int(f.get("matched_tokens") or 0))


def decision_to_proto(d: Any, cache_salt: str) -> route_pb2.RouteResponse:
    return route_pb2.RouteResponse(worker=d.worker, url=d.url, dp_rank=int(d.dp_rank or 0), verdict=str(d.verdict),
                                   matched_tokens=int(d.matched_tokens), epoch=int(d.epoch or 0),
                                   candidates=[_candidate(c) for c in (d.candidates or ())], cache_salt=cache_salt)
