"""The proxy's cache of tokenize answers: bounded in entries and in bytes, shared fairly between tenants.

Each tenant has its own LRU (a hit never reveals another tenant's text through timing). The ids are held as
4-byte unsigned integers (`array('I')`), not as a list of Python ints (36 bytes an id): a cached 1M-id answer
holds 3.8 MiB, not 35. When a bound is reached, the tenant holding the most bytes loses its least recently used
entry (the most entries, where the entry bound is what binds), so a tenant within its fair share (the budget over
the tenants using the cache) keeps its entries whatever another tenant sends. An answer larger than a quarter of the byte budget is not cached at all.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Hashable, Sequence

ID_BYTES = 4  # array('I'): every id the router accepts fits (token ids are in [0, 2**32))
ENTRY_BYTES = 200  # what an entry costs beside its ids (its key, the array header, the dict slot), for the count


class TokenCache:
    """get/put of token ids by (tenant, key); at most `max_entries` entries and `max_bytes` bytes in all."""

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._by_tenant: dict[str, OrderedDict[Hashable, array[int]]] = {}
        self._bytes: dict[str, int] = {}  # tenant -> bytes its entries hold
        self.num_entries = 0
        self.num_bytes = 0

    def get(self, tenant: str, key: Hashable) -> Sequence[int] | None:
        lru = self._by_tenant.get(tenant)
        ids = lru.get(key) if lru is not None else None
        if ids is not None:
            lru.move_to_end(key)  # type: ignore[union-attr]
        return ids

    def put(self, tenant: str, key: Hashable, ids: Sequence[int]) -> None:
        """Keep `ids` for the tenant's `key`, unless it is too large to cache or not all ids fit 32 bits (the
        router refuses those anyway: nothing is kept that a route could not use)."""
        size = len(ids) * ID_BYTES + ENTRY_BYTES
        if self.max_entries == 0 or size > self.max_bytes // 4:
            return
        lru = self._by_tenant.get(tenant)
        if lru is not None and key in lru:  # NOTE: keys are digests of the request: the same key, the same ids
            lru.move_to_end(key)
            return
        try:
            packed = array("I", ids)
        except (OverflowError, TypeError):
            return
        self._by_tenant.setdefault(tenant, OrderedDict())[key] = packed
        self._bytes[tenant] = self._bytes.get(tenant, 0) + size
        self.num_entries += 1
        self.num_bytes += size
        while self.num_entries > self.max_entries or self.num_bytes > self.max_bytes:
            self._evict()

    def tenant_bytes(self, tenant: str) -> int:
        return self._bytes.get(tenant, 0)

    def _evict(self) -> None:
        """The least recently used entry of the tenant holding the largest share of either bound."""
        tenant = max(self._bytes, key=lambda t: max(self._bytes[t] / self.max_bytes,
                                                    len(self._by_tenant[t]) / self.max_entries))
        _, ids = self._by_tenant[tenant].popitem(last=False)
        self._drop(tenant, len(ids) * ID_BYTES + ENTRY_BYTES)

    def _drop(self, tenant: str, size: int) -> None:
        self.num_entries -= 1
        self.num_bytes -= size
        self._bytes[tenant] -= size
        if not self._by_tenant[tenant]:
            del self._by_tenant[tenant], self._bytes[tenant]
