"""Redis-specific edges: a server at maxmemory refuses a put with ResourceExhausted and writes nothing."""

from __future__ import annotations

import os

import pytest
import redis

from fleet.cas import open_store
from fleet.core.errors import ResourceExhausted


def test_server_out_of_memory_is_resource_exhausted_and_writes_nothing(redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    store = open_store(redis_url)
    small = store.put(b"fits before the limit", "acme")
    used = int(r.info("memory")["used_memory"])
    r.config_set("maxmemory-policy", "noeviction")
    r.config_set("maxmemory", used + (256 << 10))
    try:
        before = sorted(r.scan_iter())
        with pytest.raises(ResourceExhausted, match="out of memory"):
            store.put(os.urandom(2 << 20), "acme")
        assert sorted(r.scan_iter()) == before
        assert store.get(small, "acme") == b"fits before the limit"  # reads still work
    finally:
        r.config_set("maxmemory", 0)
    assert len(store.put(os.urandom(2 << 20), "acme")) == 64  # control: the same put fits without the limit
    store.close()
