"""TCP relays in front of a real server, for the network faults a test needs:

- LossyRelay: once armed, passes the client's next bytes on but none of the server's answer, and resets the
  client's connection `reset_after_s` later (the server has applied the call by then): the lost answer after
  which a client may retry a call that already happened;
- SilentRelay: once silent, passes no bytes either way and closes nothing (a partition, a paused VM);
- ForwardRelay: passes every byte; setting `upstream` sends the NEXT connections elsewhere while the open ones
  stay where they were (a Service or DNS name whose target moved, as after a Redis failover)."""

from __future__ import annotations

import select
import socket
import struct
import threading
import time


class _Relay:
    """Accepts on a port of its own; each connection to `upstream` is pumped by `_pump` on a thread."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self._srv = socket.socket()
        self._srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._srv.bind(("127.0.0.1", 0))
        self._srv.listen(16)
        self.port = self._srv.getsockname()[1]
        self.address = f"127.0.0.1:{self.port}"
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._srv.close()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self._srv.accept()
            except OSError:
                return
            threading.Thread(target=self._pump, args=(c, socket.create_connection(self.upstream)), daemon=True).start()

    def _pump(self, c: socket.socket, u: socket.socket) -> None:
        raise NotImplementedError


class SilentRelay(_Relay):
    def __init__(self, upstream: tuple[str, int]) -> None:
        self.silent = False
        super().__init__(upstream)

    def _pump(self, c: socket.socket, u: socket.socket) -> None:
        try:
            while True:
                ready, _, _ = select.select([c, u], [], [], 0.05)
                if self.silent:
                    continue
                for a, b in ((c, u), (u, c)):
                    if a in ready:
                        data = a.recv(65536)
                        if not data:
                            return
                        b.sendall(data)
        except OSError:
            pass
        finally:
            c.close()
            u.close()


class ForwardRelay(SilentRelay):
    """A SilentRelay never made silent: a plain forwarder whose `upstream` a test may change."""


class LossyRelay(_Relay):
    def __init__(self, upstream: tuple[str, int], reset_after_s: float = 0.5) -> None:
        self.reset_after_s = reset_after_s
        self.armed = False
        self.resets = 0
        super().__init__(upstream)

    def _pump(self, c: socket.socket, u: socket.socket) -> None:
        cut_at: float | None = None
        try:
            while True:
                wait = None if cut_at is None else max(0.0, cut_at - time.monotonic())
                ready, _, _ = select.select([c, u], [], [], wait)
                if cut_at is not None and time.monotonic() >= cut_at:
                    self.resets += 1
                    c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST on close
                    return
                if c in ready:
                    data = c.recv(65536)
                    if not data:
                        return
                    u.sendall(data)
                    if self.armed and cut_at is None:
                        self.armed, cut_at = False, time.monotonic() + self.reset_after_s
                if u in ready:
                    data = u.recv(65536)
                    if not data:
                        return
                    if cut_at is None:
                        c.sendall(data)
        except OSError:
            pass
        finally:
            c.close()
            u.close()
