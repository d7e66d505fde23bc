"""Whether a worker's KV events stopped reaching the controller while the worker reuses its cache. Pure.

A worker whose event publisher is not where it was registered (it restarted on other `--kv-events-config` ports, a
firewall between) looks healthy: it answers its looks, and the controller calls it serving; but its index never
fills, so every route there is COLD and warm prompts go elsewhere, and nothing said so. The check, per rank, at each
look: the worker's own count of prompt tokens found in its prefix cache (`vllm:prefix_cache_hits_total`) grew, so it
holds cached blocks, each of which vLLM announced when it stored it; yet the controller's index holds none of the
rank's, and no event batch of the rank arrived, for `after_s`. Then the rank is silent until a batch arrives.
A worker that reuses nothing, or whose blocks the index holds, is never silent; a counter that went down (a new
process) starts the count again.
NOTE: the first version counted prompt tokens looked up instead of found: a worker asked the same prompts again
stores no new block, so it publishes no event, and a healthy worker was reported silent in its own test.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class _Since:
    at: float  # when the count below was read: the first look after the last batch, or with the index empty
    hits: float


class Silence:
    def __init__(self, after_s: float) -> None:
        self.after_s = after_s
        self._since: dict[int, _Since] = {}
        self.silent: set[int] = set()

    def heard(self, rank: int) -> bool:
        """A batch of `rank` arrived: its count starts again at the next look. True: it was silent."""
        self._since.pop(rank, None)
        if rank in self.silent:
            self.silent.discard(rank)
            return True
        return False

    def looked(self, rank: int, hits: float | None, indexed: int, now: float) -> bool:
        """A look read the rank's cache hits `hits` (None: the worker exports none) at `now`, with `indexed` of its
        blocks in the controller's index. True: newly silent."""
        if indexed:  # the index holds its blocks: events arrive (or did)
            self._since.pop(rank, None)
            return False
        if hits is None or rank in self.silent:
            return False
        since = self._since.get(rank)
        if since is None or hits < since.hits:
            self._since[rank] = _Since(now, hits)
            return False
        if hits > since.hits and now - since.at >= self.after_s:
            self.silent.add(rank)
            return True
        return False
