"""Redis-specific: metadata someone damaged by hand. The embedded store keeps metadata in typed
SQLite columns, so this damage cannot happen there; the case lives here, not in the shared contract."""

from __future__ import annotations

import redis

from fleet.cas import open_store


def test_gc_skips_unreadable_metadata_and_collects_the_rest(redis_url: str) -> None:
    """Metadata someone damaged (not a hash, or a field missing) is kept, never deleted blind, and
    does not stop the collection of every other tenant's expired blobs."""
    store = open_store(redis_url, clock=lambda: 1000.0, lease_s=10.0)
    bad_type, no_lease, good = (store.put(b, "acme") for b in (b"damaged 1", b"damaged 2", b"fine"))
    r = redis.Redis.from_url(redis_url)
    r.delete(f"kvf:t:acme:m:{bad_type}")
    r.set(f"kvf:t:acme:m:{bad_type}", b"not a hash")
    r.hdel(f"kvf:t:acme:m:{no_lease}", "lease_expires")
    other = store.put(b"other tenant", "beta")
    r.close()
    assert store.gc(now=5000.0) == 2
    assert not store.exists(good, "acme") and not store.exists(other, "beta")
    assert store.get(no_lease, "acme") == b"damaged 2"
    store.close()
