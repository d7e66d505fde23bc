"""A Redis failover behind the store's address (support.redis_failover: two real servers, the address moved
from the old primary to the new one, the old one demoted with the store's pooled connections still open to it).

NOTE: the store kept its pooled connections to the demoted primary, which refused every write READONLY, and
never reset them: every write failed (UNAVAILABLE to clients) for the life of the process. Now READONLY drops
the pool's idle connections and the call runs once more, through the address, on the new primary.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from support.redis_failover import FailoverPair

from fleet.cas import open_store


def test_the_first_writes_after_a_failover_reach_the_new_primary_once_each(tmp_path: Path) -> None:
    with FailoverPair(tmp_path) as pair:
        store = open_store(pair.url)
        try:
            with ThreadPoolExecutor(4) as pool:  # four pooled connections, as a controller's store threads open
                list(pool.map(lambda _: store.put(os.urandom(64), "acme"), range(32)))
            store.kv_put("t", "k", b"on A")
            pair.wait_replicated("kvf:kv:t")
            pair.failover()
            ref = store.put(b"written after the failover", "acme")  # before: Unavailable (READONLY), every time
            assert store.oplog_append("acme", "s1", {"op": "x"}) == 0  # not retried after it applied: index 0
            assert store.kv_swap("t", "k", b"on A", b"on B")
            assert pair.rb.exists(f"kvf:t:acme:b:{ref}") == 1  # on B, the new primary
            assert pair.rb.llen("kvf:t:acme:op:s1") == 1 and pair.rb.hget("kvf:kv:t", "k") == b"on B"
            assert store.get(ref, "acme") == b"written after the failover"
        finally:
            store.close()
