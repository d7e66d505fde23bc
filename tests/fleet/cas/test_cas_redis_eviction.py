"""A Redis that evicts keys without a TTL (maxmemory-policy allkeys-*) is refused at open: every key of the store is
data (blobs, op logs, the tenants' byte counts), and such a Redis drops them to make room without an error.

NOTE: before, it was opened without a word. Measured by the review (real redis-server, allkeys-lru, maxmemory
8 MiB): tenant bravo's 60 puts of 256 KiB evicted tenant acme's pinned blob (its stat and get: NOT_FOUND) and
bravo's own byte count (1.5 MB counted for 15 MB put, so its quota counted from almost nothing).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from fleet.cas import open_store
from fleet.core.errors import FailedPrecondition, NotFound


@pytest.fixture
def policy(redis_url: str) -> Iterator[redis.Redis]:
    r = redis.Redis.from_url(redis_url)
    yield r
    r.config_set("maxmemory-policy", "noeviction")


@pytest.mark.parametrize("name", ["allkeys-lru", "allkeys-lfu", "allkeys-random"])
def test_an_evicting_redis_is_refused_naming_the_policy_and_the_fix(redis_url: str, policy: redis.Redis,
                                                                    name: str) -> None:
    policy.config_set("maxmemory-policy", name)
    with pytest.raises(FailedPrecondition) as ei:
        open_store(redis_url)
    assert f"maxmemory-policy {name}" in str(ei.value) and "noeviction" in str(ei.value)
    assert policy.dbsize() == 0  # opening wrote nothing


@pytest.mark.parametrize("name", ["noeviction", "volatile-lru", "volatile-ttl"])
def test_control_a_redis_that_never_evicts_the_stores_keys_is_opened(redis_url: str, policy: redis.Redis,
                                                                    name: str) -> None:
    policy.config_set("maxmemory-policy", name)  # volatile-*: only keys with a TTL; the store sets none
    with open_store(redis_url) as store:
        ref = store.put(b"kept", "acme")
        assert store.get(ref, "acme") == b"kept"
    assert policy.ttl(f"kvf:t:acme:b:{ref}") == -1 and policy.ttl(f"kvf:t:acme:m:{ref}") == -1


@pytest.mark.parametrize("size", [1000, 300 << 10, 1 << 20])  # one command, its dedup pre-check, in pieces
def test_a_blob_whose_bytes_went_behind_the_stores_back_can_be_put_again(redis_url: str, size: int) -> None:
    """Its metadata stayed (evicted or deleted bytes): the put puts the bytes back under it, its pin and charge kept.
    NOTE: before, the metadata alone meant stored: the put "succeeded" and its get stayed NOT_FOUND for good."""
    r = redis.Redis.from_url(redis_url)
    data = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    with open_store(redis_url) as store:
        ref = store.put(data, "acme")
        store.pin(ref, "acme")
        used = store.stored_bytes("acme")
        assert store.put(data, "acme") == ref and store.stored_bytes("acme") == used  # control: a dedup
        assert r.delete(f"kvf:t:acme:b:{ref}") == 1
        with pytest.raises(NotFound):
            store.get(ref, "acme")
        assert store.stat(ref, "acme") is not None
        assert store.put(data, "acme") == ref
        assert store.get(ref, "acme") == data  # before: NotFound
        meta = store.stat(ref, "acme")
        assert meta is not None and meta.pins == 1 and store.stored_bytes("acme") == used
        assert r.ttl(f"kvf:t:acme:b:{ref}") == -1
    r.close()


def test_a_redis_set_to_evict_while_open_refuses_data_writes_until_fixed(redis_url: str, policy: redis.Redis) -> None:
    """Opened fit, then set to evict: once unfit() (the controller's store probe) has seen it, puts and op-log writes
    are refused naming the policy and the fix, and nothing is written; once it sees noeviction again, they go through.
    NOTE: before, they were acknowledged into a Redis that would drop them at its maxmemory without an error."""
    with open_store(redis_url) as store:
        kept = store.put(b"stored before", "acme")
        policy.config_set("maxmemory-policy", "allkeys-lru")
        assert store.put(b"before the probe looked", "acme")  # control: the refusal follows what the probe saw
        assert store.unfit() is not None
        keys = policy.dbsize()
        for write in (lambda: store.put(b"x" * 100, "acme"), lambda: store.put(b"y" * (2 << 20), "acme"),
                      lambda: store.put_many([b"z"], "acme"), lambda: store.oplog_append("acme", "s1", {"op": 1}),
                      lambda: store.oplog_replace("acme", "s1", [{"op": 1}])):
            with pytest.raises(FailedPrecondition) as ei:
                write()
            assert "maxmemory-policy allkeys-lru" in str(ei.value) and "noeviction" in str(ei.value)
        assert policy.dbsize() == keys and store.get(kept, "acme") == b"stored before"  # reads go on
        policy.config_set("maxmemory-policy", "noeviction")
        assert store.unfit() is None
        assert store.get(store.put(b"after the fix", "acme"), "acme") == b"after the fix"
        assert store.oplog_append("acme", "s1", {"op": 1}) == 0
