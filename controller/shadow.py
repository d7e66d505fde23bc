"""The router's block-pool shadows: a RankPool (controller/shadow_pool.py) per (worker, dp_rank), and each route's
rank, so a route's prompts are freed where they were admitted.
"""

from __future__ import annotations

from collections.abc import Sequence

from controller.shadow_pool import UNSENT_S, RankPool

RankKey = tuple[str, int]


class ShadowPools:
    """A RankPool per (worker, dp_rank), created once its capacity is known, rebuilt if it changes."""

    def __init__(self, grace_s: float = 5.0, unsent_s: float = UNSENT_S) -> None:
        self.grace_s, self.unsent_s = grace_s, unsent_s
        self._pools: dict[RankKey, RankPool] = {}
        self._route_key: dict[str, RankKey] = {}
        self._parts: dict[str, int] = {}  # a batch's route -> its prompts (only where more than one)

    def get(self, key: RankKey) -> RankPool | None:
        return self._pools.get(key)

    def pool(self, key: RankKey, num_gpu_blocks: int | None) -> RankPool | None:
        p = self._pools.get(key)
        if num_gpu_blocks is None or num_gpu_blocks < 2:
            return p
        if p is None or p.num_gpu_blocks != num_gpu_blocks:
            p = self._pools[key] = RankPool(num_gpu_blocks, self.grace_s, self.unsent_s)
        return p

    def allocate(
        self,
        key: RankKey,
        route: str,
        chain: Sequence[int],
        num_partial: int,
        num_gpu_blocks: int | None,
        now: float,
        speculative: str | None = None,
        owner: str | None = None,
        part: int = 0,
    ) -> list[int]:
        """`part`: the prompt of a batch (0: the first, or the only one); vLLM runs each prompt of a batch as a request
        of its own, so each is one in the pool, and all are freed with the route."""
        p = self.pool(key, num_gpu_blocks)
        if p is None:
            return []
        if speculative is not None:
            return p.speculate(chain, num_partial, now, speculative)
        self._route_key[route] = key
        if part:
            self._parts[route] = max(self._parts.get(route, 1), part + 1)
        return p.allocate(_part_name(route, part), chain, num_partial, now, owner=owner)

    def free(self, route: str, now: float) -> None:
        key = self._route_key.pop(route, None)
        p = self._pools.get(key) if key is not None else None
        num_parts = self._parts.pop(route, 1)
        if p is not None:
            for part in range(num_parts):
                p.free(_part_name(route, part), now)

    def resident_prefix(self, key: RankKey, chain: Sequence[int], matched: int, now: float, owner: str = "") -> int:
        p = self._pools.get(key)
        return p.resident_prefix(chain, matched, now, owner) if p is not None and matched else matched

    def forget(self, key: RankKey) -> None:
        """Every hash on the rank is gone (a clear, an epoch drop)."""
        p = self._pools.get(key)
        if p is not None:
            p.cleared()

    def drop_worker(self, worker: str) -> None:
        for k in [k for k in self._pools if k[0] == worker]:
            del self._pools[k]
        for r in [r for r, k in self._route_key.items() if k[0] == worker]:
            del self._route_key[r]
            self._parts.pop(r, None)


def _part_name(route: str, part: int) -> str:
    """The pool's name for one prompt of a route: the route's own for its first (route ids are hex, never with '/')."""
    return f"{route}/{part}" if part else route
