"""One rank's blocks as the block-pool shadow (controller/shadow_pool.py) models vLLM's pool holding them: the free
queue in eviction order (never-used blocks at its front, then hashes or unhashed names), the ref counts of pinned
blocks, each route's blocks, the evictions predicted and not confirmed yet; and the moves every part of the model
makes on them (a hit touched out of the queue, a block taken off its front, what requests admitted in order
would take).

Its parts build on it: controller/shadow_unsent.py (tracked routes no event has shown sent, and how one is undone),
controller/shadow_events.py (the KV events' corrections), then `RankPool` (admission, frees).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from itertools import count

from controller.free_queue import FreeQueue, Key

_ANON = count()


def anon_key() -> str:
    """A name for an unhashed free block (a partial block freed, or a hash cleared in place): a str, never a hash
    (an int). NOTE: was an instance of a class of its own, which the cyclic collector tracks: as a key it would make
    the free queue's dicts tracked, and the collector walk every block in them (controller/free_queue.py)."""
    return f"anon{next(_ANON)}"


class RankBlocks:
    """One rank's blocks: the free queue in eviction order, ref counts of pinned hashed blocks."""

    def __init__(self, num_gpu_blocks: int) -> None:
        if num_gpu_blocks < 2:
            raise ValueError(f"num_gpu_blocks must be >= 2 (one is vLLM's null block), got {num_gpu_blocks}")
        self.num_gpu_blocks = num_gpu_blocks
        self._fresh = num_gpu_blocks - 1  # never-used blocks at the queue's front
        self._free = FreeQueue()  # then these, front first: hashes or anon_key names
        self._ref: dict[int, int] = {}  # pinned hashed blocks: hash -> ref_cnt (> 0)
        self._anon_pinned = 0  # pinned unhashed blocks (partial ones)
        self._ghost: dict[int, int] = {}  # pinned blocks whose hash was dropped meanwhile -> ref_cnt
        self._held: dict[str, list[int | None]] = {}  # route -> its blocks in order (None: unhashed)
        # predicted evictions -> (when, the tenant whose Routes alone believe it: an untracked route's, or, once
        # past unsent_s, a tracked one's not shown sent (an Unconfirmed); None: every tenant's), oldest first
        self.evicted: OrderedDict[int, tuple[float, str | None]] = OrderedDict()
        self._front_seq: dict[Key, int] = {}  # blocks an undo put back at the front -> when they were taken

    def cached(self, h: int) -> bool:
        return h in self._ref or h in self._free.has

    def queue(self) -> list[int | None]:
        """The free queue, front (next evicted) first: hashes, None for unhashed blocks (fresh last seen)."""
        return [None] * self._fresh + [k if isinstance(k, int) else None for k in self._free]

    def num_free(self) -> int:
        return self._fresh + len(self._free)

    def _taken_by(self, requests: Iterable[tuple[Sequence[int], int, str | None]]) -> set[int]:
        """Hashes `requests` (a rank's waiting ones: chain, partial blocks, owner) will evict when admitted, replayed
        in their order (first come, first served): each touches its hit out of the queue (the leading blocks cached
        now and not taken by one admitted before it), then takes a new block for every block after it from the queue's front, fresh blocks first, past the
        blocks the ones before it touched. NOTE: before, their need was a sum counted at each one's arrival and
        their hits in the queue counted as blocks taken: a waiting turn whose previous turn's blocks lay at the
        front, or whose hit was evicted while it waited (by one admitted before it, too), left as many of the next
        blocks out of the risk, and a route trusted them (stale WARM routes in the agents16x4/very-tight cell,
        issued with no reset or sleep near them; tests/controller/test_shadow_lockstep.py found the second)."""
        free, ref, fresh = self._free.has, self._ref, self._fresh
        front = iter(self._free)
        touched: set[int] = set()
        out: set[int] = set()
        for chain, num_partial, _ in requests:
            hit = 0
            for h in chain:  # its hit (`RankPool._hit`), as the pool will be when it is admitted
                if h in free and h not in out:
                    touched.add(h)
                elif h not in ref and h not in touched:
                    break
                hit += 1
            need = len(chain) - hit + num_partial
            if fresh >= need:
                fresh -= need
                continue
            need, fresh = need - fresh, 0
            for k in front:
                if k in touched:
                    continue
                if isinstance(k, int):
                    out.add(k)
                need -= 1
                if need <= 0:
                    break
        return out

    def _pinned(self) -> bool:
        return bool(self._ref or self._anon_pinned or self._ghost)

    def _touch(self, h: int) -> None:
        if h in self._free.has:
            self._free.remove(h)
            self._front_seq.pop(h, None)
            self._ref[h] = 1
        else:
            self._ref[h] += 1

    def _popleft(self) -> int | None:
        """Take the front block; the hash it carried (evicted), or None."""
        if self._fresh:
            self._fresh -= 1
            return None
        k = self._free.popleft()
        self._front_seq.pop(k, None)
        return k if isinstance(k, int) else None
