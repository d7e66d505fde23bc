"""Replay ROUTER sockets that hold every replay request until the test lets them go (a worker whose catch-up replay
does not answer): the catch-up tests and the leader's start under a held replay use them."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import zmq
import zmq.asyncio

from controller.vllm.subscriber import StreamLimits

END = b"\xff" * 8
# long enough that a held replay outlasts every wait below: the tests never wait for it to time out
HELD = StreamLimits(replay_timeout_s=60.0, replay_deadline_s=120.0)


class HeldReplay:
    """Replay ROUTERs at `port`, `port + 1`, ... (rank r's at + r) that take requests and answer none until
    `released` is set: then an empty replay (the end marker) to each, and to every request while it stays set
    (cleared again, the next requests are held). `port`: where the first one binds (default: a free port)."""

    def __init__(self, ctx: zmq.asyncio.Context, ranks: int, port: int | None = None) -> None:
        self.socks, self.requests, given = [], 0, port
        for _ in range(1 if given is not None else 100):
            if given is None:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", 0))
                    port = int(s.getsockname()[1])
            try:
                for r in range(ranks):
                    sock = ctx.socket(zmq.ROUTER)
                    sock.setsockopt(zmq.LINGER, 0)
                    self.socks.append(sock)
                    sock.bind(f"tcp://127.0.0.1:{port + r}")
                break
            except zmq.ZMQError:
                for sock in self.socks:
                    sock.close(0)
                self.socks = []
        assert self.socks, f"no free ports for {ranks} replay sockets"
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.released = asyncio.Event()
        self._tasks = [asyncio.get_running_loop().create_task(self._serve(s)) for s in self.socks]

    async def _serve(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            ident, _, _start = await sock.recv_multipart()
            self.requests += 1
            await self.released.wait()
            await sock.send_multipart([ident, b"", b"", END, b""])

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t
        for s in self.socks:
            s.close(0)
