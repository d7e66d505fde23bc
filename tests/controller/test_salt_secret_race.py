"""Two controllers starting at once on a new store agree on the cache_salt secret (controller/server.py _salt_secret).

Real SQLite store; only the order of the two starts' store calls is forced: both read (no secret yet), then A writes
and reads back, then B. NOTE: the write was an unconditional put: B's overwrote A's, and A served with a secret that
no later controller would use, so its tenants' warm prefixes went cold at the next failover (review finding, on a
real Redis with three replicas' first start).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from controller.config import ControllerConfig
from controller.server import SALT_SECRET_KEY, _salt_secret
from fleet.cas import open_store


def test_two_controllers_starting_at_once_keep_one_secret(tmp_path: Path) -> None:
    store = open_store(f"sqlite:///{tmp_path}/kv.db")
    both_read, a_done = threading.Barrier(2), threading.Event()

    class Forced:
        """The store, each controller's calls ordered: both first reads before any write, A's start before B's write."""

        def __init__(self, name: str) -> None:
            self.name, self.reads = name, 0

        def kv_get(self, ns: str, key: str) -> Any:
            value = store.kv_get(ns, key)
            self.reads += 1
            if self.reads == 1:
                both_read.wait(10)
            return value

        def _before_write(self) -> None:
            if self.name == "B":
                assert a_done.wait(10)

        def kv_put(self, *a: Any) -> Any:
            self._before_write()
            return store.kv_put(*a)

        def kv_swap(self, *a: Any) -> Any:
            self._before_write()
            return store.kv_swap(*a)

    cfg = ControllerConfig(store_url=f"sqlite:///{tmp_path}/kv.db")
    got: dict[str, bytes] = {}

    def start(name: str) -> None:
        got[name] = _salt_secret(Forced(name), cfg)
        if name == "A":
            a_done.set()

    threads = [threading.Thread(target=start, args=(n,)) for n in "AB"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    stored = bytes(store.kv_get(*SALT_SECRET_KEY))
    print(f"A {got['A'].hex()[:12]}, B {got['B'].hex()[:12]}, stored {stored.hex()[:12]}")
    assert got["A"] == got["B"] == stored and len(stored) == 32
    store.close()
