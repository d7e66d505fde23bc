"""Where the router and a watcher meet: a frozen snapshot of one worker, taken per decision.

Routing reads workers only through these (`Worker.view()`, controller/vllm/watcher.py), never a
watcher's fields; the listing adds each rank's RankState (a frozen value too). A view does not
change under the router while it ranks; after an await (the hashing thread, a probe) it takes a
new one.

NOTE: NamedTuples, not frozen dataclasses: the router takes two views of every worker per route
(before and after it hashes off the loop), and a frozen slotted dataclass of eight fields takes
about three times as long to build (measured 2.0 vs 0.6 us on the dev machine).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal, NamedTuple

from controller.vllm.http import WorkerMetrics
from fleet.core.block_hash import HashConfig


class RankView(NamedTuple):
    """One rank as the router may see it. `serving`: a candidate (serving, no verb in flight);
    `warmable`: its index may lower a cost (serving, calibrated, block size known)."""

    dp_rank: int
    epoch: int
    serving: bool
    warmable: bool


class WorkerView(NamedTuple):
    """A snapshot of one worker for one routing decision: what it serves, how it hashes, its last
    /metrics look (taken at monotonic `load_at`: `load`, the first rank's engine's series, and `loads`, each
    rank's engine's, read by `rank_load`) and its ranks, by global DP rank."""

    name: str
    url: str
    model: str
    loras: Mapping[str, str]
    hash_cfg: HashConfig | None
    load: WorkerMetrics
    load_at: float | None
    ranks: tuple[RankView, ...]
    loads: tuple[WorkerMetrics, ...] = ()

    def has_rank(self, dp_rank: int) -> bool:
        return 0 <= dp_rank - self.ranks[0].dp_rank < len(self.ranks)

    def rank(self, dp_rank: int) -> RankView:
        """The rank by its global DP rank (the ranks run from the spec's dp_rank_start, in order)."""
        rv = self.ranks[dp_rank - self.ranks[0].dp_rank]
        assert rv.dp_rank == dp_rank, (rv, dp_rank)
        return rv

    def rank_load(self, dp_rank: int) -> WorkerMetrics:
        """The rank's own engine's load (running, waiting, KV usage, pool size) at the last look."""
        i = dp_rank - self.ranks[0].dp_rank
        return self.loads[i] if 0 <= i < len(self.loads) else self.load

    def adapter(self, model: str, lora: str | None) -> str | None | Literal[False]:
        """The LoRA adapter a request for `model` (and `lora`) runs here, None for the base model;
        False: this worker does not serve it."""
        adapter = lora or (model if model in self.loras else None)
        if model != self.model and model not in self.loras or (adapter and adapter not in self.loras):
            return False
        return adapter

    def lora_key(self, adapter: str | None) -> tuple[str, str] | None:
        """The (name, path) a LoRA adds to the block hash's extra keys (None: base model)."""
        return (adapter, self.loras[adapter]) if adapter else None

    def chain_key(self, adapter: str | None) -> tuple[HashConfig | None, str | None, str | None]:
        """Workers with equal keys hash a prompt to the same block chain (hashed once per decision)."""
        return (self.hash_cfg, adapter, self.loras.get(adapter or ""))
