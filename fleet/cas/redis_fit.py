"""Whether a Redis can keep what the store gives it: one whose maxmemory-policy evicts keys without a TTL (allkeys-*)
cannot, since every key of the store is data. The store refuses such a Redis when it is opened, and the controller's
store probe asks again while it runs (a store can be replaced behind its address, or reconfigured).

NOTE: such a Redis was opened without a word, and at its maxmemory one tenant's puts evicted other tenants' pinned
blobs (a later get: NOT_FOUND) and their own byte count (so their quota counted from 0 again). The volatile-* policies
evict only keys with a TTL, and the store sets one only on a large put's pieces in flight and on the tenant's set of
their reservations: evicting pieces fails that put (Unavailable, nothing stored), evicting reservations leaves those
puts to the commit's quota check, and stored data is refused writes as under noeviction. INFO, not CONFIG GET, which
managed Redis services often forbid; one that forbids INFO too is opened.
NOTE: a Redis set to evict while the controller ran read NOT_SERVING, but a client that called on went on storing
blobs and op logs into it, acknowledged, for it to drop without an error at its maxmemory. The store now refuses
those writes while the last check found it evicting (RedisBlobStore._refuse_while_evicting), until a check finds the
policy fixed.
"""

from __future__ import annotations

from typing import Any

import redis


def eviction_refusal(r: Any, where: str) -> str | None:
    """Why the Redis at `where` (host:port), read through client `r`, cannot keep the store's data, else None."""
    try:
        policy = str(r.info("memory").get("maxmemory_policy", ""))
    except redis.exceptions.ResponseError:  # INFO refused (an ACL, a renamed command): nothing to check
        return None
    if not policy.startswith("allkeys-"):
        return None
    return (f"redis at {where} evicts keys when it is full (maxmemory-policy {policy}): it would drop blobs, op logs "
            "and byte counts, any tenant's to make room for another's, without an error. Set maxmemory-policy "
            "noeviction on it (a full store then refuses writes with RESOURCE_EXHAUSTED and keeps what it holds), or "
            "give kvfleet a Redis of its own")
