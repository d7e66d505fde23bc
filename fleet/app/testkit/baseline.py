"""What shipped routers do, for comparison only: an index cleared on AllBlocksCleared and nothing else.

No serving state, no epochs, no gap repair, no reconcile loop (llm-d after #626, aibrix after
#2385). The chaos test runs it beside `Router` on the same traces to count its stale routes.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import zmq
import zmq.asyncio

from controller.index import PrefixIndex
from controller.vllm.events import EventDecodeError, decode_batch
from fleet.core.block_hash import HashConfig, external_chain


@dataclass(frozen=True, slots=True)
class BaselineDecision:
    worker: str
    verdict: str
    matched_tokens: int


class BaselineRouter:
    """Subscribes to each worker's PUB; applies events; clears a worker only on AllBlocksCleared."""

    def __init__(self, hash_cfg: HashConfig) -> None:
        self.cfg = hash_cfg
        self.index = PrefixIndex()
        self.seq: dict[str, int] = {}
        self._ctx = zmq.asyncio.Context()
        self._tasks: list[asyncio.Task[None]] = []
        self._socks: list[zmq.asyncio.Socket] = []
        self.names: list[str] = []

    def add_worker(self, name: str, endpoint: str) -> None:
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(endpoint)
        self._socks.append(sock)
        self.names.append(name)
        self._tasks.append(asyncio.get_running_loop().create_task(self._run(name, sock)))

    async def _run(self, name: str, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart()
            if len(frames) < 3:
                continue
            self.seq[name] = int.from_bytes(frames[1][:8], "big")
            with contextlib.suppress(EventDecodeError):
                for ev in decode_batch(frames[2]).events:
                    self.index.apply((name, 0), ev)  # AllBlocksCleared clears; nothing else does

    def route(self, token_ids: Sequence[int], cache_salt: str | None = None) -> BaselineDecision:
        hashes = external_chain(self.cfg, token_ids, cache_salt=cache_salt)
        best = max(self.names, key=lambda n: (self.index.match((n, 0), hashes), n))
        m = self.index.match((best, 0), hashes)
        return BaselineDecision(best, "WARM" if m else "COLD", m * self.cfg.block_size)

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t
        for s in self._socks:
            s.close(0)
        self._ctx.term()
