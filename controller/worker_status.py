"""What the router says about its workers: one status row per (worker, rank), checked field by field
for its wire type (a corrupt state lists as "error", never as serving), and the checks a worker passes
before it is watched (its persisted rank states, the hash settings it reports)."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from controller.index import PrefixIndex
from controller.metrics import Metrics
from controller.registry import EpochTable, WorkerSpec
from controller.vllm.http import VllmHttp, worker_hash_settings
from controller.vllm.watcher import Worker
from fleet.core.block_hash import ALGOS
from fleet.core.errors import FailedPrecondition
from fleet.core.rank_state import RankState

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class WorkerStatus:
    name: str
    url: str
    model: str
    dp_rank: int
    phase: str
    kv: str
    serving: bool
    warm: bool
    epoch: int
    last_seq: int
    num_blocks: int
    load: float
    kv_usage: float
    fence: str
    spec: WorkerSpec


def status_row(w: Worker, r: int, index: PrefixIndex) -> WorkerStatus:
    """One rank's row; every field checked for its wire type (a bad one raises here, not in proto)."""
    st, v, key = w.ranks[r], w.view(), (w.spec.name, r)
    faulty = w.faulty()  # over its KV-event budget (controller/vllm/budget.py): listed as such, not serving
    # "draining": a verb of this controller lets the requests in flight finish (lifecycle.lists_draining): not
    # serving, yet what was sent there is answered there (the proxy waits for it; NOTE: it pulled every request)
    return WorkerStatus(
        v.name,
        v.url,
        v.model,
        r,
        "faulty" if faulty else "draining" if w.draining else _typed(st.phase, str),
        _typed(st.kv, str),
        _typed(st.serving, bool) and not faulty,
        _typed(v.rank(r).warmable, bool) and bool(index.resident(key)),
        _typed(st.epoch, int),
        _typed(w.applied_seq(r), int),  # a batch being applied in slices is not read yet
        index.num_blocks(key),
        float(v.rank_load(r).running + v.rank_load(r).waiting),
        float(v.rank_load(r).kv_usage),
        _typed(st.fence, str),
        w.spec,
    )


def resumed_ranks(epochs: EpochTable, spec: WorkerSpec, metrics: Metrics) -> dict[int, RankState]:
    """A known worker's persisted rank states (a corrupt one reads as a fresh, cold rank). Blocking."""
    ranks = {}
    for r in spec.dp_rank_ids:
        try:
            st = epochs.get(spec.name, r) or RankState()
            check_rank_state(st)
        except Exception:
            metrics.worker_errors.labels("start").inc()
            log.exception("worker %s rank %d: persisted state unreadable; starting it cold", spec.name, r)
            st = RankState()
        ranks[r] = dataclasses.replace(st, serving=False)  # trust nothing until seen
    return ranks


async def agreed_spec(spec: WorkerSpec, http: VllmHttp) -> WorkerSpec:
    """The spec with the worker's own hash algorithm; refuse one the worker contradicts.

    NOTE: a sha256_cbor worker registered as sha256 (the old default) was never warm, while
    its index filled and `worker ls` said warm.

    Raises:
        FailedPrecondition: the worker reports another hash algorithm or block size than the
            spec, or an algorithm nobody outside it can recompute (xxhash).
    """
    seen = await worker_hash_settings(http)
    algo, bs = seen.get("hash_algo"), seen.get("block_size")
    where = f"worker {spec.name!r} ({spec.url}) reports"
    if algo is not None and algo not in ALGOS:
        raise FailedPrecondition(f"{where} prefix_caching_hash_algo={algo!r}, which cannot be recomputed "
                                 f"outside it; run vLLM with --prefix-caching-hash-algo sha256_cbor")
    if algo is not None and spec.hash_algo is not None and algo != spec.hash_algo:
        raise FailedPrecondition(f"{where} prefix_caching_hash_algo={algo!r} but the spec says "
                                 f"{spec.hash_algo!r}; register it with hash_algo={algo!r} or leave it empty")
    if isinstance(bs, int) and spec.block_size is not None and bs != spec.block_size:
        raise FailedPrecondition(f"{where} block_size={bs} but the spec says {spec.block_size}; "
                                 f"register it with block_size={bs} or leave it empty")
    return dataclasses.replace(spec, hash_algo=spec.hash_algo or algo or "sha256")  # vLLM's default


def _typed(v: Any, kind: type) -> Any:
    if type(v) is not kind:
        raise TypeError(f"expected {kind.__name__}, got {v!r:.40}")
    return v


def check_rank_state(st: RankState) -> None:
    """A persisted rank state with the types it was written with (else: corrupt)."""
    for name in ("epoch", "seq", "epoch_seq"):
        _typed(getattr(st, name), int)
    _typed(st.serving, bool)


def error_status(spec: WorkerSpec, r: int) -> WorkerStatus:
    """The fail-closed row of a worker whose state cannot be read: not serving, nothing warm."""
    return WorkerStatus(spec.name, spec.url, spec.model, r, "error", "unknown", False, False, -1, -1, 0,
                        0.0, 0.0, "", spec)
