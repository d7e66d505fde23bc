"""ZMQ PUB of KV-event batches plus the replay ROUTER, as vLLM's ZmqEventPublisher.

Live frames: [topic, seq (8B BE), payload]. Replay: a DEALER sends [b"", start_seq]; the ROUTER
answers every buffered batch with seq >= start_seq as [b"", topic, seq, payload] (>= 0.26) or
[b"", seq, payload] (older), then the end marker with seq 0xFF*8.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from typing import Any

import zmq
import zmq.asyncio

from fleet.app.testkit.sim_vllm.wire import encode_batch

END_SEQ = b"\xff" * 8


PUB_HWM = 100_000  # vLLM's KVEventsConfig hwm (and max_queue_size) default: past it the PUB drops silently


class BindError(OSError):
    """A port the stand-in cannot listen on; `what` says which: "http", "kv_events" or "replay"."""

    def __init__(self, what: str, host: str, port: int, reason: str) -> None:
        super().__init__(f"cannot listen on {host}:{port} ({reason})")
        self.what = what


def _bind(sock: zmq.Socket[Any], host: str, port: int, what: str) -> int:
    try:
        if port == 0:
            return int(sock.bind_to_random_port(f"tcp://{host}"))
        sock.bind(f"tcp://{host}:{port}")
    except zmq.ZMQError as e:
        sock.close(0)
        raise BindError(what, host, port, e.strerror.split(" (addr=")[0]) from e  # the address is in the message
    return port


class Publisher:
    """One DP rank's publisher. `drop_next` simulates lossy PUB (HWM): batches stay replayable."""

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        replay_port: int | None = 0,
        topic: str = "",
        buffer_steps: int = 10000,
        dp_rank: int = 0,
        legacy_replay: bool = False,
    ) -> None:
        self.topic = topic.encode()
        self.dp_rank = dp_rank
        self.legacy_replay = legacy_replay
        self.seq = 0
        self.drop_next = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._pub: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, PUB_HWM)  # NOTE: ZMQ's default (1000) dropped a slow subscriber's batches
        self.port = _bind(self._pub, host, port, "kv_events")                      # 100x sooner than vLLM (review)
        self._ctx = zmq.asyncio.Context()
        self.endpoint = f"tcp://{host}:{self.port}"
        self._router: zmq.asyncio.Socket | None = None
        self.replay_endpoint: str | None = None
        if replay_port is not None:
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self._router.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))
            try:
                self.replay_endpoint = f"tcp://{host}:{_bind(self._router, host, replay_port, 'replay')}"
            except BindError:
                self._pub.close(0)
                self._ctx.term()
                raise
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._router is not None:
            self._task = asyncio.get_running_loop().create_task(self._serve_replay())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        self._pub.close(0)
        if self._router is not None:
            self._router.close(0)
        self._ctx.term()

    def publish(self, events: list[Any]) -> int:
        """Encode and send one batch; returns its seq."""
        seq = self.seq
        self.seq += 1
        payload = encode_batch(time.time(), events, self.dp_rank)
        self.buffer.append((seq, payload))
        if self.drop_next > 0:
            self.drop_next -= 1
        else:
            self._pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK)
        return seq

    def restart(self) -> None:
        """A new publisher lifetime: seq from 0, replay buffer lost."""
        self.seq = 0
        self.buffer.clear()

    async def _serve_replay(self) -> None:
        assert self._router is not None
        while True:
            frames = await self._router.recv_multipart()
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) < 8:
                continue  # vLLM logs and ignores any other shape, with no reply
            ident, start = frames[0], int.from_bytes(frames[2][:8], "big")
            for seq, payload in list(self.buffer):
                if seq >= start:
                    body = (
                        [seq.to_bytes(8, "big"), payload]
                        if self.legacy_replay
                        else [self.topic, seq.to_bytes(8, "big"), payload]
                    )
                    await self._router.send_multipart([ident, b"", *body])
            end = [END_SEQ, b""] if self.legacy_replay else [b"", END_SEQ, b""]
            await self._router.send_multipart([ident, b"", *end])
