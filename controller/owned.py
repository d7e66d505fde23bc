"""Per-owner bookkeeping that stays fair at a cap: past it, the owner with the most entries loses its own,
so one tenant's flood never evicts another's (one tenant never slows another)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class Counts:
    """A count per key and a key with the largest count, each change of one by 1 in O(1) (buckets by count)."""

    __slots__ = ("_by", "_n", "_top")

    def __init__(self) -> None:
        self._n: dict[str, int] = {}
        self._by: dict[int, dict[str, None]] = {}  # count -> the keys with it
        self._top = 0

    def add(self, k: str, d: int) -> None:
        """Count `k` up (d = 1) or down (d = -1)."""
        c = self._n.get(k, 0)
        if c:
            b = self._by[c]
            del b[k]
            if not b:
                del self._by[c]
        c += d
        if c:
            self._n[k] = c
            self._by.setdefault(c, {})[k] = None
        else:
            del self._n[k]
        if c > self._top:
            self._top = c
        while self._top and self._top not in self._by:
            self._top -= 1

    def largest(self) -> str:
        return next(iter(self._by[self._top]))


class OwnedLru(Generic[K, V]):
    """At most `cap` entries by key, each with an owner; past the cap the owner with the most entries loses its
    oldest. get, put and pop are O(1)."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._by: dict[str, OrderedDict[K, V]] = {}  # owner -> its entries, oldest first
        self._owner: dict[K, str] = {}
        self._counts = Counts()

    def __len__(self) -> int:
        return len(self._owner)

    def __contains__(self, key: object) -> bool:
        return key in self._owner

    def get(self, key: K) -> V | None:
        owner = self._owner.get(key)
        return None if owner is None else self._by[owner][key]

    def put(self, key: K, owner: str | None, value: V) -> None:
        self.pop(key)
        o = owner or ""
        self._by.setdefault(o, OrderedDict())[key] = value
        self._owner[key] = o
        self._counts.add(o, 1)
        while len(self._owner) > self.cap:
            largest = self._counts.largest()
            oldest = next(iter(self._by[largest]))
            self.pop(oldest)

    def pop(self, key: K) -> V | None:
        owner = self._owner.pop(key, None)
        if owner is None:
            return None
        entries = self._by[owner]
        value = entries.pop(key)
        if not entries:
            del self._by[owner]
        self._counts.add(owner, -1)
        return value
