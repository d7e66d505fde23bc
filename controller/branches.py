"""Which block hashes are shared prefixes (a system prompt, a few-shot preamble): the forks the router learns from
the chains it routes. The cost (controller/cost.py) counts a missing shared prefix at `shared_prefix_weight`; each
tenant observes into its own Branches (controller/tenant_branches.py).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from fleet.core.errors import InvalidArgument


class Branches:
    """Which block hashes are shared prefixes: seen followed by `fanout` different blocks (a radix fork
    that several conversations continue).

    A system prompt or a few-shot preamble is one (every conversation continues it differently); a
    conversation's own history is not (each turn continues it the same way), so warm affinity keeps
    its full credit. Three, not two: a conversation whose last block is rewritten by its next turn
    (a partial block that fills with different tokens, a regenerated answer) continues its own
    history a second way, and counting that as shared cancelled its warm credit: on the Mooncake
    trace (issue #27) every turn forked its conversation's previous one, so kvfleet placed returning
    turns by load alone and hit barely more than round robin.
    Bounded in two generations of `max_blocks` / 2 hashes each: when the newer one is full, the older one
    is forgotten and the newer one becomes the older. A hash observed again is carried into the newer
    generation with what was known of it, so a prefix in use survives any flood of new ones; what no
    request observed for a whole generation is learned again. Before, past `max_blocks` it forgot
    everything at once: one tenant's 17 distinct 1M-token prompts reset every tenant's shared prefixes to 0.
    Thread-safe: a long prompt's chain is observed in its hashing thread (controller/hash_lane.py), a short one's on
    the event loop; each observation is whole under a lock, so each sees the others' all or not at all.
    """

    def __init__(self, max_blocks: int = 1 << 20, fanout: int = 3) -> None:
        if fanout < 2:
            raise InvalidArgument(f"fanout must be >= 2, got {fanout}")
        self.max_blocks, self.fanout = max_blocks, fanout
        self._next: dict[int, tuple[int, ...]] = {}  # block hash -> the distinct blocks seen after it
        self._forks: set[int] = set()
        self._old: dict[int, tuple[int, ...]] = {}  # the older generation of both
        self._old_forks: set[int] = set()
        self._lock = threading.Lock()

    def observe(self, chain: Sequence[int]) -> int:
        """Record the chain's transitions; return how many leading blocks are shared (up to its last fork)."""
        with self._lock:
            return self._observe(chain)

    def num_blocks(self) -> int:
        """Hashes held, both generations (a hash in both counts twice)."""
        return len(self._next) + len(self._old)

    def rotate(self) -> None:
        """Forget the older generation; the newer one becomes the older."""
        with self._lock:
            self._rotate()

    def _rotate(self) -> None:
        self._old, self._next = self._next, {}
        self._old_forks, self._forks = self._forks, set()

    def _observe(self, chain: Sequence[int]) -> int:
        if len(self._next) > self.max_blocks // 2:
            self._rotate()
        nxt, forks, k, old, old_forks = self._next, self._forks, self.fanout, self._old, self._old_forks
        for h, after in zip(chain, chain[1:], strict=False):  # NOTE: each block and the next
            seen = nxt.get(h)
            if seen is None and h in old:  # in use again: carried into the newer generation
                seen = nxt[h] = old[h]
                if h in old_forks:
                    forks.add(h)
            if seen is None:
                nxt[h] = (after,)
            elif after not in seen and h not in forks:
                if len(seen) + 1 >= k:
                    forks.add(h)
                else:
                    nxt[h] = (*seen, after)
        if forks or old_forks:
            for i in range(len(chain) - 1, -1, -1):  # NOTE: the last fork; usually a system prompt's end
                if chain[i] in forks or chain[i] in old_forks:
                    return i + 1
        return 0
