"""A whole-blob read asks Redis for a bounded window of chunks a round trip, on a real redis-server.

Redis runs every command of a pipeline that has arrived before it serves another client, so a get that sent one
pipeline of all of a large blob's chunks had Redis copy the whole blob into its reply while every other tenant
waited. The store talks to Redis through a TCP forwarder here that counts the GETRANGE commands in each burst
the client sends (the client waits for a window's replies before it sends the next window, so two windows
never share a burst).
"""

from __future__ import annotations

import os
import socket
import threading

from fleet.cas import open_store
from fleet.cas.redis_reads import _GET_CHUNK, _GET_WINDOW


class CountingProxy:
    """Forwards one TCP connection to `upstream`, counting the GETRANGE commands of each client->server read."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.bursts: list[int] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        client, _ = self.listener.accept()
        upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
        threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()
        self._pump(client, upstream, True)

    def _pump(self, src: socket.socket, dst: socket.socket, count: bool) -> None:
        try:
            while data := src.recv(1 << 20):
                if count and b"GETRANGE" in data:
                    self.bursts.append(data.count(b"GETRANGE"))
                dst.sendall(data)
        except OSError:
            pass
        finally:
            dst.close()


def test_whole_blob_get_asks_for_a_window_of_chunks_a_round_trip(redis_url: str, redis_server) -> None:  # type: ignore[no-untyped-def]
    data = os.urandom(16 * _GET_CHUNK + 7)  # 17 chunks
    with open_store(redis_url) as s:
        ref = s.put(data, "acme")
    proxy = CountingProxy(redis_server.port)
    url = f"redis://127.0.0.1:{proxy.port}/0"
    with open_store(url) as store:
        assert store.get(ref, "acme") == data
        assert store.get_many([ref, ref], "acme") == [data, data]
    print(f"GETRANGE commands per burst: {proxy.bursts}")
    assert max(proxy.bursts) <= _GET_WINDOW  # before: one burst of all 16 chunks after the first
    # control: every chunk was asked for (3 reads of 17 chunks each)
    assert sum(proxy.bursts) == 3 * 17
