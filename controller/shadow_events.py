"""The block-pool shadow's corrections by KV events (controller/shadow_pool.py): a BlockStored the model did not
predict takes a slot, as the real pool had to, and its request's cache hit rejoins the queue's tail behind its new
blocks (`_hit_chain`, walked through each stored hash's parent); a BlockRemoved frees the hash; a clear or an epoch
drop empties the model, its blocks kept. A BlockStored of an unsent tracked route's new block shows that route sent
(controller/shadow_unsent.py).

It builds on the blocks and the unsent routes; `RankPool` (admission, frees) builds on it.
"""

from __future__ import annotations

from collections.abc import Iterable

from controller.shadow_unsent import UnsentRoutes


class ShadowEvents(UnsentRoutes):
    """A rank's blocks and unsent routes, corrected by the rank's KV events."""

    def __init__(self, num_gpu_blocks: int) -> None:
        super().__init__(num_gpu_blocks)
        self._parent: dict[int, int] = {}  # a hash -> the block before it in its chain (stored events); kept
        # through predicted evictions and undone routes (pruned when over twice the pool), dropped on BlockRemoved

    def stored(self, hashes: Iterable[int], now: float, parent: int | None = None) -> None:
        """BlockStored: a block the model did not place takes a slot, the way the pool had to, and they queue last
        block first (a BlockStored is one request's chain: vLLM frees a request's blocks tail first). One of an
        unsent tracked route's new blocks shows that route sent: every tenant believes its evictions from now.
        `parent` (the event's parent_block_hash) and the blocks before it were that request's cache hit: vLLM
        touched them, and they rejoin the tail after its new blocks, the chain's first block last (`_hit_chain`).

        NOTE: they queued in stored order, head first: after a replay (a restart) the shadow expected LRU to evict
        the oldest prompt's first block, hiding all of it, where vLLM drops its last blocks first."""
        hit = self._hit_chain(parent)  # NOTE: out of the queue first, as vLLM touches a hit before taking blocks
        new: list[int] = []
        prev = parent
        for h in hashes:
            if prev is not None:
                self._parent[h] = prev
            prev = h
            if self._unsent_block:
                r = self._unsent_block.get(h)
                if r is not None:
                    self._sent(r)
            self.evicted.pop(h, None)
            if self.cached(h):
                continue
            if h in self._ghost:
                # a block of a request still running, stored again after a clear (it ran, or was preempted and
                # ran again, after the reset): pinned and hashed again in its slot, so that when the request
                # ends it rejoins the tail, last block first. Queued as free here, it went head first, and the
                # shadow expected LRU to evict a rebuilt history's first block at once.
                self._ref[h] = self._ghost.pop(h)
                continue
            if self.num_free():
                gone = self._popleft()
                if gone is not None:
                    self.evicted[gone] = (now, None)
                new.append(h)
        self._free.extend([*reversed(new), *hit])  # NOTE: its request may still hold them; unknown here, so evictable
        if len(self._parent) > 2 * self.num_gpu_blocks:  # links of hashes no longer cached here
            self._parent = {h: p for h, p in self._parent.items() if self.cached(h) or h in self.evicted}

    def _hit_chain(self, h: int | None) -> list[int]:
        """A stored request hit `h` and every block before it in its chain: the free ones leave the queue (they rejoin
        its tail after the request's new blocks, `h` first and the chain's first block last, as vLLM frees a request
        when it ends), and are returned in that order; pinned ones stay with their route; one predicted evicted is
        not (the hit shows vLLM kept it: the index is trusted again). NOTE: an untracked Route leaves the pool as it
        is, so before, the hits of a request that was sent never moved: a long conversation's prefix kept the place
        its first turn gave it, and the shadow predicted LRU evicting what vLLM, which touched it every turn, kept
        (WARM routed COLD). Taken out after the new blocks' slots, a hit could be the block a new one evicted."""
        free, parent, ev = self._free, self._parent, self.evicted
        out: list[int] = []
        for _ in range(self.num_gpu_blocks):  # NOTE: a bound, not a count: a chain is never longer than the pool
            if h is None:
                break
            if h in free.has:
                free.remove(h)
                self._front_seq.pop(h, None)
                out.append(h)
            elif h in ev:
                del ev[h]
            elif h not in self._ref:
                break
            h = parent.get(h)
        return out

    def removed(self, hashes: Iterable[int]) -> None:
        """BlockRemoved: confirmed. A hash the model still held frees its slot (an unknown request took it)."""
        for h in hashes:
            self.evicted.pop(h, None)
            self._parent.pop(h, None)
            if h in self._free.has:
                self._free.remove(h)
                self._front_seq.pop(h, None)
                self._fresh += 1  # NOTE: at the front: reused by someone, it is the next slot taken
            elif h in self._ref:
                self._ghost[h] = self._ghost.get(h, 0) + self._ref.pop(h)

    def cleared(self) -> None:
        """AllBlocksCleared, an epoch drop (sleep, reset, restart): every hash is gone, blocks stay."""
        for h, n in self._ref.items():
            self._ghost[h] = self._ghost.get(h, 0) + n
        self._ref.clear()
        self._fresh += len(self._free)
        self._free.clear()
        self._front_seq.clear()
        self.evicted.clear()
        self._parent.clear()
