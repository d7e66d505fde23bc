"""A Redis failover behind a stable address, with real servers: A is the primary and B its replica, and clients
are given a ForwardRelay's address that reaches A. `failover()` does what Sentinel or a managed Redis does:
B becomes the primary, the address sends new connections to B, and A is demoted to B's replica. Connections
already open to A stay open, and A answers their writes READONLY from then on.

    with FailoverPair(tmp_path) as pair:
        store = open_store(pair.url)
        ...
        pair.failover()
"""

from __future__ import annotations

import time
from pathlib import Path

import redis

from fleet.app.redis_server import RedisServer
from support.lossy_relay import ForwardRelay


class FailoverPair:
    def __init__(self, tmp_path: Path) -> None:
        (tmp_path / "a").mkdir()
        (tmp_path / "b").mkdir()
        self.a = RedisServer(dir=str(tmp_path / "a")).start()
        self.b = RedisServer(dir=str(tmp_path / "b")).start()
        self.ra, self.rb = redis.Redis(port=self.a.port), redis.Redis(port=self.b.port)
        self.rb.replicaof("127.0.0.1", self.a.port)
        self.relay = ForwardRelay(("127.0.0.1", self.a.port))
        self.url = f"redis://127.0.0.1:{self.relay.port}/0"

    def __enter__(self) -> FailoverPair:
        return self

    def __exit__(self, *exc: object) -> None:
        self.relay.close()
        for r in (self.ra, self.rb):
            r.close()
        for srv in (self.a, self.b):
            srv.close()

    def wait_replicated(self, key: str, timeout_s: float = 10.0) -> None:
        """Until B, the replica, holds `key` (written on A): what A had is on B when the failover comes."""
        deadline = time.monotonic() + timeout_s
        while not self.rb.exists(key):
            assert time.monotonic() < deadline, f"B never got {key!r} from A"
            time.sleep(0.02)

    def failover(self) -> None:
        self.rb.replicaof("NO", "ONE")
        self.relay.upstream = ("127.0.0.1", self.b.port)
        self.ra.replicaof("127.0.0.1", self.b.port)
