"""Failed pieced puts whose stage and reservation Redis did not take back (it was down), remembered per tenant until
the store's next put gives them back (fleet/cas/redis_pieces.py: PiecedPut._drop and drop_undropped).

A remembered put that is pushed out is not lost for good: its stage and reservation lapse STAGE_TTL_MS after its last
piece. Until then its reservation counts against its tenant's quota (the blob's charge: up to 64 MiB) and its stage
holds the pieces it sent in Redis (measured: a put failed at its third piece held 1 MiB of stage and 1,573,381 bytes
of quota, 117 s to go). So the bounds are per tenant, and one tenant's failures push out only its own:

- a tenant keeps its newest MAX_PER_TENANT; an older one of its own goes first;
- all tenants together keep MAX_TOTAL; when full, the oldest entry of the tenant holding the most goes (the adding
  tenant's on a tie). A tenant holding fewer than the most is never pushed out by another, and while at most
  MAX_TOTAL / MAX_PER_TENANT (16) tenants hold any, no tenant's is pushed out by another at all.

NOTE: one list for every tenant kept the newest 1,024: one tenant's failed puts while Redis was down pushed out
every other tenant's, which then held their quota and Redis memory for the 120 s.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Generic, TypeVar

T = TypeVar("T")

MAX_PER_TENANT = 64
MAX_TOTAL = 1024


class Undropped(Generic[T]):
    """Per-tenant queues of what is still to give back, oldest first; thread-safe."""

    def __init__(self, per_tenant: int = MAX_PER_TENANT, total: int = MAX_TOTAL) -> None:
        assert 0 < per_tenant <= total, (per_tenant, total)
        self.per_tenant, self.total = per_tenant, total
        self._by_tenant: dict[str, deque[T]] = {}
        self._num = 0
        self._lock = threading.Lock()

    def add(self, tenant: str, item: T) -> None:
        """Remember `item` as `tenant`'s newest, pushing out by the rules of the module doc."""
        with self._lock:
            q = self._by_tenant.setdefault(tenant, deque())
            q.append(item)
            self._num += 1
            if len(q) > self.per_tenant:
                self._pop_oldest(tenant)
            elif self._num > self.total:
                self._pop_oldest(max(self._by_tenant, key=lambda t: (len(self._by_tenant[t]), t == tenant)))

    def take_all(self) -> list[tuple[str, T]]:
        """Everything remembered, as (tenant, item), each tenant's oldest first; forgotten here."""
        with self._lock:
            out = [(tenant, item) for tenant, q in self._by_tenant.items() for item in q]
            self._by_tenant, self._num = {}, 0
        return out

    def __len__(self) -> int:
        return self._num

    def held(self, tenant: str) -> int:
        """How many of `tenant`'s are remembered."""
        return len(self._by_tenant.get(tenant, ()))

    def _pop_oldest(self, tenant: str) -> None:
        q = self._by_tenant[tenant]
        q.popleft()
        self._num -= 1
        if not q:
            del self._by_tenant[tenant]
