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
