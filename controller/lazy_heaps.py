"""Max-heaps cleaned lazily: a change costs O(log n) and the largest is read in O(1) amortized, its stale
entries leaving when they reach the top (or all at once, when they outnumber the live ones).

The working set (controller/demand.py) keeps, per rank, the largest shared-prefix size of each stage's records
(`SizeMultiset`) and the largest rate-weighted one over its stages (`KeyedMax`), so a Route reads a rank's demand
with a few heap peeks.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class KeyedMax(Generic[K]):
    """A value per key and the largest: a heap whose stale entries leave when they reach its top (or all
    at once, when they outnumber the live ones), so a change costs O(log n) and a look O(1) amortized."""

    __slots__ = ("_heap", "_v")

    def __init__(self) -> None:
        self._v: dict[K, float] = {}
        self._heap: list[tuple[float, K]] = []  # (-value, key); live while _v[key] == value

    def __len__(self) -> int:
        return len(self._v)

    def set(self, k: K, v: float) -> None:
        if self._v.get(k) == v:
            return
        self._v[k] = v
        heapq.heappush(self._heap, (-v, k))
        self._compact()

    def discard(self, k: K) -> None:
        if self._v.pop(k, None) is not None:
            self._compact()

    def max(self) -> float:
        """The largest value (0 when empty)."""
        h, v = self._heap, self._v
        while h and v.get(h[0][1]) != -h[0][0]:
            heapq.heappop(h)
        return -h[0][0] if h else 0.0

    def max_without(self, k: K) -> float:
        """The largest value of any other key (0 when none)."""
        h, v, held = self._heap, self._v, []
        while h:
            x, key = h[0]
            if v.get(key) != -x:
                heapq.heappop(h)
            elif key == k:
                held.append(heapq.heappop(h))
            else:
                break
        m = -h[0][0] if h else 0.0
        for e in held:
            heapq.heappush(h, e)
        return m

    def _compact(self) -> None:
        if len(self._heap) > 2 * len(self._v) + 16:
            self._heap = [(-x, k) for k, x in self._v.items()]
            heapq.heapify(self._heap)


class SizeMultiset:
    """The shared-prefix sizes of one stage's records on a rank (a multiset) and the largest: a heap of
    one entry per record, whose removals below its top wait in `_gone` until they reach it."""

    __slots__ = ("_gone", "_heap", "_n")

    def __init__(self) -> None:
        self._heap: list[int] = []  # -size per record; its top is never one removed
        self._gone: dict[int, int] | None = None  # sizes removed but still in the heap: how many
        self._n = 0

    def __bool__(self) -> bool:
        return self._n > 0

    def add(self, s: int) -> None:
        heapq.heappush(self._heap, -s)
        self._n += 1

    def remove(self, s: int) -> None:
        self._n -= 1
        h = self._heap
        if h[0] == -s:
            heapq.heappop(h)
            self._settle()
            return
        g = self._gone = self._gone or {}
        g[s] = g.get(s, 0) + 1
        if len(h) > 2 * self._n + 16:
            keep = []
            for x in h:
                if g.get(-x):
                    g[-x] -= 1
                else:
                    keep.append(x)
            heapq.heapify(keep)
            self._heap, self._gone = keep, None

    def _settle(self) -> None:
        g, h = self._gone, self._heap
        while g and h and -h[0] in g:
            s = -heapq.heappop(h)
            if g[s] > 1:
                g[s] -= 1
            else:
                del g[s]
        if not g:
            self._gone = None

    def max(self) -> int:
        return -self._heap[0] if self._n else 0

    def max_without_one(self, s: int) -> int:
        """The largest size once one record of size `s` leaves."""
        h = self._heap
        if not self._n or -h[0] != s:
            return self.max()
        top = heapq.heappop(h)
        self._settle()
        m = -h[0] if h else 0
        heapq.heappush(h, top)
        return m
