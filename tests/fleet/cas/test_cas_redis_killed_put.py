"""A put whose client process dies mid-transfer leaves no blob, no charge, and no key that outlives its TTL.

The client talks to Redis through a small TCP forwarder that stalls after 1 MiB of the request; the
client process is SIGKILLed while stalled, the bytes that did arrive are delivered, the connection is
closed, and Redis is inspected: the pre-existing keys remain as they were, and the only other key is the
put's staging key (its pieces so far, fleet/cas/redis_pieces.py), with a TTL, which Redis then expires
(the client shortened the TTL to 1.5 s). Control: the same put through the same forwarder without a stall
creates exactly the blob's two keys and its tenant's byte count.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time

import redis

from fleet.cas import blob_charge, open_store


class StallingProxy:
    """Forwards one TCP connection to `upstream`; client->server stops after `stall_after` bytes until released."""

    def __init__(self, upstream_port: int, stall_after: int | None) -> None:
        self.upstream_port, self.stall_after = upstream_port, stall_after
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.forwarded = 0
        self.stalled, self.release, self.closed = threading.Event(), threading.Event(), threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        client, _ = self.listener.accept()
        upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
        threading.Thread(target=self._pump_down, args=(upstream, client), daemon=True).start()
        try:
            self._pump_up(client, upstream)
        finally:  # NOTE: shutdown() first: close() alone does not wake the other pump's blocked recv
            for sock in (upstream, client):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()
            self.closed.set()

    def _pump_up(self, client: socket.socket, upstream: socket.socket) -> None:
        while data := client.recv(65536):
            if self.stall_after is not None and self.forwarded + len(data) > self.stall_after \
                    and not self.release.is_set():
                self.stalled.set()
                self.release.wait()
            upstream.sendall(data)
            self.forwarded += len(data)

    @staticmethod
    def _pump_down(upstream: socket.socket, client: socket.socket) -> None:
        try:
            while data := upstream.recv(65536):
                client.sendall(data)
        except OSError:
            pass


_CLIENT = """
import os, sys
import fleet.cas.redis_pieces
from fleet.cas import open_store
fleet.cas.redis_pieces.STAGE_TTL_MS = 1500
store = open_store(sys.argv[1])
print(store.put(os.urandom(16 << 20), "acme"), flush=True)
"""


def _keys(r: redis.Redis) -> set[bytes]:
    return set(r.scan_iter(count=1000))


def _wait_clients(r: redis.Redis, n: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while int(r.info("clients")["connected_clients"]) > n:
        assert time.monotonic() < deadline, "redis still sees the dead client's connection"
        time.sleep(0.05)


def test_client_killed_mid_put_leaves_no_key(redis_url: str, redis_server) -> None:  # type: ignore[no-untyped-def]
    r = redis.Redis.from_url(redis_url)
    with open_store(redis_url) as store:
        store.put(b"pre-existing blob", "acme")
    before, count = _keys(r), r.get("kvf:t:acme:bytes")
    assert len(before) == 3 and count == str(blob_charge(len(b"pre-existing blob"))).encode()  # blob, metadata, byte count
    baseline = int(r.info("clients")["connected_clients"])

    proxy = StallingProxy(redis_server.port, stall_after=1 << 20)
    client = subprocess.Popen([sys.executable, "-c", _CLIENT, f"redis://127.0.0.1:{proxy.port}/0"],
                              stdout=subprocess.PIPE)
    assert proxy.stalled.wait(30), "the put never reached the stall point"
    assert client.poll() is None  # still inside put(), blocked mid-transfer
    client.send_signal(signal.SIGKILL)
    client.wait()
    proxy.release.set()  # deliver whatever the dead client had already sent, then close
    assert proxy.closed.wait(30)
    _wait_clients(r, baseline)  # redis has seen the connection close
    print(f"forwarded {proxy.forwarded} of >{16 << 20} request bytes before the client died; "
          f"keys before {len(before)}, after {r.dbsize()}")
    assert 1 << 20 <= proxy.forwarded < 16 << 20
    staged = _keys(r) - before
    assert _keys(r) >= before and all(k.startswith(b"kvf:t:acme:p:") or k == b"kvf:t:acme:inflight"
                                      for k in staged), staged   # its pieces, and the bytes they reserve
    assert all(0 < int(r.pttl(k)) <= 1500 for k in staged)  # type: ignore[arg-type]
    assert r.get("kvf:t:acme:bytes") == count  # the dead put counted nothing
    deadline = time.monotonic() + 10
    while _keys(r) != before:  # its pieces expire
        assert time.monotonic() < deadline, _keys(r) - before
        time.sleep(0.1)
    assert r.dbsize() == 3 and r.get("kvf:t:acme:bytes") == count


def test_control_same_put_through_the_proxy_without_stall_stores_its_keys(redis_url: str, redis_server) -> None:  # type: ignore[no-untyped-def]
    r = redis.Redis.from_url(redis_url)
    proxy = StallingProxy(redis_server.port, stall_after=None)
    out = subprocess.run([sys.executable, "-c", _CLIENT, f"redis://127.0.0.1:{proxy.port}/0"],
                         capture_output=True, check=True, timeout=60)
    ref = out.stdout.decode().strip()
    assert proxy.forwarded > 16 << 20
    assert _keys(r) == {f"kvf:t:acme:b:{ref}".encode(), f"kvf:t:acme:m:{ref}".encode(), b"kvf:t:acme:bytes"}
    assert int(r.get("kvf:t:acme:bytes")) == blob_charge(int(r.strlen(f"kvf:t:acme:b:{ref}")))  # type: ignore[arg-type]
