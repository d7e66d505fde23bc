"""Redis-specific edges: a server at maxmemory refuses a put with ResourceExhausted and writes nothing."""

from __future__ import annotations

import json
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


def test_a_store_url_naming_a_service_that_is_not_redis_is_a_clear_error() -> None:
    # before: redis-py's InvalidResponse left `kvfleet controller --store redis://...` as a traceback
    import socket
    import threading

    from fleet.core.errors import Unavailable

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)

    def http_everywhere() -> None:  # what an nginx answers to anything
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            with c:
                c.recv(65536)
                c.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")

    threading.Thread(target=http_everywhere, daemon=True).start()
    try:
        with pytest.raises(Unavailable, match="does not answer as Redis does"):
            open_store(f"redis://127.0.0.1:{srv.getsockname()[1]}/0").stat("a" * 64, "acme")
    finally:
        srv.close()


def test_a_verdict_cache_hit_at_maxmemory_is_answered_and_a_kv_put_is_resource_exhausted(redis_url: str) -> None:
    """At maxmemory (noeviction) a plain command's OOM reply reaches redis-py as OutOfMemoryError, its "OOM" cut from
    the message: kv_put raised it raw, and a verdict-cache hit due its last-use touch failed with it though the
    verdict was readable. Now kv_put raises ResourceExhausted and the hit is answered, its touch counted as not
    written. Control: a hit with no touch due is answered either way, and the touch is written without the limit."""
    from fleet.core.quarantine import DetectorConfig, VerdictCache, make_detector
    from fleet.core.quarantine.cache import TOUCH_INTERVAL_S

    r = redis.Redis.from_url(redis_url)
    store = open_store(redis_url)
    now = [1_000_000.0]
    cache = VerdictCache(store, make_detector(DetectorConfig()), clock=lambda: now[0])
    data = b"The weather in Paris is sunny."
    first = cache.inspect(data, "acme")  # a miss: judged and stored
    r.config_set("maxmemory-policy", "noeviction")
    r.config_set("maxmemory", int(r.info("memory")["used_memory"]) + 1024)
    try:
        with pytest.raises(ResourceExhausted, match="out of memory"):
            store.kv_put("ns", "k", b"x" * 100_000)
        now[0] += 60
        assert cache.inspect(data, "acme") == first and cache.num_touch_failures == 0  # no touch due
        now[0] += TOUCH_INTERVAL_S
        assert cache.inspect(data, "acme") == first and cache.cached(data, "acme") == first
        assert cache.num_touch_failures == 2
    finally:
        r.config_set("maxmemory", 0)
    assert cache.inspect(data, "acme") == first and cache.num_touch_failures == 2
    assert json.loads(store.kv_get(cache.ns("acme"), cache.key(data)) or b"{}")["used"] == now[0]
    store.close()
