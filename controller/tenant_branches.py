"""The Branches (controller/branches.py) of each tenant, sharing one bound: one tenant's flood of new prompts never makes
another tenant's shared prefixes forgotten.

Each tenant's chains are hashed with its own cache_salt, so no fork is shared across tenants: each tenant's
observations go to a Branches of its own (two generations of `max_blocks` / 2 hashes, as before). While more than one
tenant holds any, their hashes together stay within `max_blocks`: past it, the tenant holding the most forgets its
older generation (its newer one becomes the older), until they fit. A lone tenant has the whole bound, as before.
NOTE: the generations were shared: one tenant's 17 distinct 1M-token prompts (1.1M new hashes) turned them over twice,
and another tenant's system prompt, not sent meanwhile, was forgotten (64 shared blocks, then 0): its next turns were
weighed as if they shared nothing, until three of its conversations had taught the fork again.
Cost: the running total is kept as each observation changes it (O(1) in the tenants); only past the bound is the
largest tenant looked for.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from controller.branches import Branches


class TenantBranches:
    """observe(chain, owner): Branches.observe on the owner's own Branches; at most `max_blocks` hashes in all."""

    def __init__(self, max_blocks: int = 1 << 20, fanout: int = 3) -> None:
        self.max_blocks, self.fanout = max_blocks, fanout
        self._by: dict[str, Branches] = {}
        self._total = 0  # every tenant's hashes: kept as they change, so a route never sums over the tenants
        self._lock = threading.Lock()  # NOTE: a long prompt's chain is observed in its hashing thread (hash_lane.py)

    def observe(self, chain: Sequence[int], owner: str | None = None) -> int:
        """Record the chain's transitions for `owner`; return how many leading blocks are shared (to its last fork)."""
        with self._lock:
            mine = self._by.get(owner or "")
            if mine is None:
                mine = self._by[owner or ""] = Branches(self.max_blocks, self.fanout)
            before = mine.num_blocks()
            shared = mine.observe(chain)
            self._total += mine.num_blocks() - before
            while len(self._by) > 1 and self._total > self.max_blocks:
                largest = max(self._by, key=lambda o: self._by[o].num_blocks())  # only past the bound
                b = self._by[largest]
                before = b.num_blocks()
                b.rotate()
                self._total += b.num_blocks() - before
                if not b.num_blocks():
                    del self._by[largest]
            return shared

    def num_blocks(self, owner: str | None = None) -> int:
        """Hashes held: `owner`'s, or every tenant's (None)."""
        if owner is not None:
            b = self._by.get(owner)
            return b.num_blocks() if b is not None else 0
        return sum(b.num_blocks() for b in self._by.values())
