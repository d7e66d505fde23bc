"""Prefix index: which block hashes each (worker, dp_rank) holds, per (group_idx, medium).

Only medium "GPU" (or None, vLLM's GPU pool before tiers existed) counts toward a warm hit
(reference §6 rule 8). A rank that has reported more than one KV group (hybrid models: Gemma 3, gpt-oss, Llama 4)
is matched as vLLM's HybridKVCacheCoordinator finds its hit: the longest prefix every group serves, a full-attention
group from block 0, a sliding-window group only the cdiv(window - 1, block_size) blocks before the hit's end
(SlidingWindowManager.find_longest_cache_hit), shortened until every group agrees. So the sliding-window group's old
blocks, which vLLM frees as the window slides and then evicts, cost no hit. Any other kind (Mamba, chunked local),
a group whose kind or window its events do not say (vLLM before 0.33), or groups of different block sizes fail
closed: no hit. NOTE: every hybrid rank used to fail closed, so a prompt vLLM held in every group was routed COLD.

The index also learns a rank's GPU capacity when vLLM does not export it: a GPU BlockRemoved means
the pool had to evict, so the blocks resident just before it were as many as fit (the router's KV
pressure term, controller/cost.py). The learned capacity survives epoch drops (the pool's size does
not change with its contents) and is forgotten with the worker.

A tier's hashes are the keys of a plain dict (values None), not a set: CPython's cyclic collector tracks every
set and walks all its members, while a dict holding only ints and None is never tracked, so it walks none.
NOTE: with sets, router_bench's index (64 workers x 100k blocks) made each full collection take 250-265 ms,
every Route waiting on the event loop stalled meanwhile, and the young collections walked each rank's set
while it filled (a replay after a restart, a refill after a clear): up to 90 ms each (docs/routing.md,
"The cyclic garbage collector and the index").
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import Protocol

from controller.vllm.events import AllBlocksCleared, BlockRemoved, BlockStored, Event

RankKey = tuple[str, int]  # (worker, dp_rank)
Tier = tuple[int | None, str]  # (group_idx, medium)
# Tiers one rank may report: vLLM's KV groups (1, or a few for hybrid models) times its media (GPU, and
# CPU or disk with an offloading connector). A store that would open one more trips the worker
# (controller/vllm/rank_events.py). NOTE: the tiers were unbounded and each non-GPU tier had its own block
# bound: 6 events of 1,048,576 CPU hashes, one tier each, held 6.3M blocks (+538 MiB) for one rank.
MAX_TIERS = 32
# One tier's resident hashes: a dict's keys, values None (never a set: see the module's docstring).
Hashes = dict[int, None]
FULL_KINDS = frozenset({"full_attention", "mla_attention"})
WINDOW_KINDS = frozenset({"sliding_window", "sliding_window_mla"})


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """A GPU KV group as its latest BlockStored described it."""

    kind: str | None
    window: int | None
    block_size: int


def tier_of(group_idx: int | None, medium: str | None) -> Tier:
    return (group_idx, "GPU" if medium is None else medium.upper())


@dataclass(slots=True)
class RankIndex:
    """Resident hashes of one (worker, dp_rank), by tier."""

    tiers: dict[Tier, Hashes] = field(default_factory=dict)
    groups: dict[int | None, GroupSpec] = field(default_factory=dict)

    def store(self, ev: BlockStored) -> None:
        self.tiers.setdefault(tier_of(ev.group_idx, ev.medium), {}).update(zip(ev.block_hashes, repeat(None)))
        if tier_of(ev.group_idx, ev.medium)[1] == "GPU":
            self.groups[ev.group_idx] = GroupSpec(ev.kind, ev.window, ev.block_size)

    def remove(self, ev: BlockRemoved) -> None:
        s = self.tiers.get(tier_of(ev.group_idx, ev.medium))
        if s is not None:
            for h in ev.block_hashes:
                s.pop(h, None)

    def num_offgpu_blocks(self) -> int:
        """Blocks in every non-GPU tier (offloaded copies: never matched, bounded together)."""
        return sum(len(s) for (_, medium), s in self.tiers.items() if medium != "GPU")

    def num_gpu_blocks(self) -> int:
        """GPU-resident blocks over every KV group (what occupies the pool)."""
        return sum(len(s) for (_, medium), s in self.tiers.items() if medium == "GPU")

    def clear(self) -> None:
        self.tiers.clear()
        self.groups.clear()

    def gpu(self) -> Hashes | None:
        """The GPU hashes of the one KV group, or of a hybrid's first full-attention (else sliding-window) group
        when `hit` can match its groups; else None (fail closed)."""
        kinds = self._kinds()
        if kinds is None:
            return None
        full, window = kinds
        return self.tiers.get(((full or window)[0][0], "GPU"))

    def hit(self, hashes: Sequence[int]) -> int:
        """Leading blocks of `hashes` vLLM would reuse: one group's leading run, or a hybrid's hit (module doc)."""
        if len(self.groups) == 1:  # the hot path: one group
            return _leading(self.tiers.get((next(iter(self.groups)), "GPU")), hashes)
        kinds = self._kinds()
        if kinds is None:
            return 0
        full, window = kinds
        n = min((_leading(self.tiers.get((g, "GPU")), hashes) for g, _ in full), default=len(hashes))
        while True:
            m = n
            for g, need in window:
                m = _window_hit(self.tiers.get((g, "GPU")), hashes, m, need)
            if m == n:
                return n
            n = m

    def _kinds(self) -> tuple[list[tuple[int | None, int]], list[tuple[int | None, int]]] | None:
        """(full-attention groups, (sliding-window group, blocks its window needs)), a single group counting as
        full; None where the groups cannot be matched (module doc)."""
        if len(self.groups) == 1:
            return [(next(iter(self.groups)), 0)], []
        specs = self.groups.items()
        if not specs or len({s.block_size for _, s in specs}) != 1:
            return None
        full = [(g, 0) for g, s in specs if s.kind in FULL_KINDS]
        window = [(g, -(-(s.window - 1) // s.block_size)) for g, s in specs
                  if s.kind in WINDOW_KINDS and s.window is not None and s.window > 0 and s.block_size > 0]
        return (full, window) if len(full) + len(window) == len(self.groups) else None

    def num_blocks(self) -> int:
        return sum(len(s) for s in self.tiers.values())


def _leading(s: Hashes | None, hashes: Sequence[int]) -> int:
    if not s:
        return 0
    n = 0
    for h in hashes:
        if h not in s:
            break
        n += 1
    return n


def _window_hit(s: Hashes | None, hashes: Sequence[int], max_len: int, need: int) -> int:
    """SlidingWindowManager.find_longest_cache_hit: from block `max_len` - 1 down, the first run of `need` cached
    blocks ends the hit; none found, the blocks cached from block 0 on are the hit."""
    run = 0
    for i in range(min(max_len, len(hashes)) - 1, -1, -1):
        if s and hashes[i] in s:
            run += 1
            if run >= need:
                return i + run
        else:
            run = 0
    return run


class IndexSink(Protocol):
    """What a watcher may do to the router's index: apply its ranks' events in stream order, drop
    a rank (epoch bump), and read what a capacity check needs. PrefixIndex implements it."""

    def apply(self, key: RankKey, ev: Event) -> None: ...

    def drop(self, key: RankKey) -> None: ...

    def num_blocks(self, key: RankKey) -> int: ...

    def held_and_new(self, key: RankKey, ev: BlockStored) -> tuple[int, int]: ...

    def opens_tier(self, key: RankKey, ev: BlockStored) -> int: ...


class PrefixIndex:
    """All ranks' resident hashes; `match` walks a request's hash chain from block 0."""

    def __init__(self) -> None:
        self._ranks: dict[RankKey, RankIndex] = {}
        self._capacity: dict[RankKey, int] = {}
        # told of every event applied and of every drop (None): the router's demand ledger and
        # block-pool shadow follow the index (a clear or an epoch drop is a cache loss)
        self.observer: Callable[[RankKey, Event | None], None] | None = None

    def rank(self, key: RankKey) -> RankIndex:
        r = self._ranks.get(key)
        if r is None:
            r = self._ranks[key] = RankIndex()
        return r

    def apply(self, key: RankKey, ev: Event) -> None:
        """Apply one event in stream order (a store after a clear in one batch is valid)."""
        r = self.rank(key)
        if isinstance(ev, BlockStored):
            r.store(ev)
        elif isinstance(ev, BlockRemoved):
            if tier_of(ev.group_idx, ev.medium)[1] == "GPU":
                self._capacity[key] = max(self._capacity.get(key, 0), r.num_gpu_blocks())
            r.remove(ev)
        elif isinstance(ev, AllBlocksCleared):
            r.clear()
        if self.observer is not None:
            self.observer(key, ev)

    def held_and_new(self, key: RankKey, ev: BlockStored) -> tuple[int, int]:
        """For a capacity check: the blocks the rank holds where `ev` would go (every GPU group for a
        GPU store, else every non-GPU tier), and how many of `ev`'s hashes are not in `ev`'s tier yet."""
        tier = tier_of(ev.group_idx, ev.medium)
        r = self._ranks.get(key) or RankIndex()
        held = r.num_gpu_blocks() if tier[1] == "GPU" else r.num_offgpu_blocks()
        return held, len(set(ev.block_hashes).difference(r.tiers.get(tier, ())))

    def opens_tier(self, key: RankKey, ev: BlockStored) -> int:
        """The rank's tier count once `ev` is stored, if `ev` opens a tier it has not got; else 0."""
        r = self._ranks.get(key)
        tiers = r.tiers if r is not None else {}
        return 0 if tier_of(ev.group_idx, ev.medium) in tiers else len(tiers) + 1

    def drop(self, key: RankKey) -> None:
        """Forget everything about a rank (epoch bump)."""
        self._ranks.pop(key, None)
        if self.observer is not None:
            self.observer(key, None)

    def drop_worker(self, worker: str) -> None:
        for k in [k for k in self._ranks if k[0] == worker]:
            del self._ranks[k]
        for k in [k for k in self._capacity if k[0] == worker]:
            del self._capacity[k]

    def match(self, key: RankKey, hashes: Sequence[int]) -> int:
        """Number of leading blocks of `hashes` resident on the rank's GPU tier."""
        r = self._ranks.get(key)
        return r.hit(hashes) if r is not None else 0

    def resident(self, key: RankKey) -> set[int]:
        r = self._ranks.get(key)
        s = r.gpu() if r is not None else None
        return set(s or ())

    def num_blocks(self, key: RankKey) -> int:
        r = self._ranks.get(key)
        return r.num_blocks() if r is not None else 0

    def residency(self, key: RankKey, hashes: Sequence[int] | None) -> tuple[int, int, int | None]:
        """One lookup for the router's cost: (`match` of `hashes` or 0, `num_resident`, `learned_capacity`)."""
        r = self._ranks.get(key)
        if r is None:
            return 0, 0, self._capacity.get(key)
        return r.hit(hashes) if hashes else 0, r.num_gpu_blocks(), self._capacity.get(key)

    def num_resident(self, key: RankKey) -> int:
        """GPU blocks resident on the rank (0 if unknown)."""
        r = self._ranks.get(key)
        return r.num_gpu_blocks() if r is not None else 0

    def learned_capacity(self, key: RankKey) -> int | None:
        """GPU blocks that fit on the rank, as its evictions showed (None before its first eviction)."""
        return self._capacity.get(key)

    def keys(self) -> Iterable[RankKey]:
        return list(self._ranks)
