"""What one worker's KV-event stream may make the controller hold or spend, bounded (regressions).

Real ZMQ sockets (a replay ROUTER in its own thread, a PUB) and the real Subscriber / Router; each
test observes bytes held, budget trips, the worker marked faulty or the blocks indexed, never timings.
"""

from __future__ import annotations

import threading
from typing import Any

import zmq
import zmq.asyncio

from controller.metrics import Metrics
from controller.vllm.subscriber import Subscriber
from fleet.app.testkit.sim_vllm import wire

END = b"\xff" * 8


class _Sink:
    def __init__(self) -> None:
        self.seq, self.applied, self.invalid = -1, [], []

    def last_seq(self) -> int:
        return self.seq

    def on_batch(self, seq, batch) -> None:  # type: ignore[no-untyped-def]
        self.seq = seq
        self.applied.append(seq)

    def on_invalidate(self, reason, seq) -> None:  # type: ignore[no-untyped-def]
        self.invalid.append(reason)


class _TailReplay:
    """A replay ROUTER (own thread) answering each request from `start` with `batches` copies of
    `payload` (seqs start, start + 1, ...) and the end marker, as vLLM's replay does."""

    def __init__(self, payload: bytes, batches: int) -> None:
        self.payload, self.batches = payload, batches
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.endpoint = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(50):
                continue
            ident, _, start = self.sock.recv_multipart()
            s = int.from_bytes(start, "big")
            for i in range(self.batches):
                self.sock.send_multipart([ident, b"", b"", (s + i).to_bytes(8, "big"), self.payload])
            self.sock.send_multipart([ident, b"", b"", END, b""])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close(0)
        self.ctx.term()


def _stored_batch(events: int, hashes: int, block_size: int = 16, first: int = 1 << 40) -> bytes:
    """An honest batch: `events` BlockStored of `hashes` blocks each, with real-sized token ids."""
    evs: list[Any] = []
    h = first
    for _ in range(events):
        evs.append(wire.VllmBlockStored(block_hashes=list(range(h, h + hashes)), parent_block_hash=h - 1,
                                        token_ids=[100_000 + i for i in range(hashes * block_size)],
                                        block_size=block_size, lora_id=None, medium="GPU", lora_name=None))
        h += hashes
    return wire.encode_batch(0.0, evs, 0)


async def test_tail_replayed_batches_are_remembered_by_digest_not_payload() -> None:
    """Each tail poll's batches used to stay held, payload and all, until 4,096 seqs later: three
    polls of 40 x 91 KiB batches held 10.6 MiB. Now a 16-byte digest per seq; a live duplicate of a
    replayed batch is still skipped and a different batch at that seq still reads as a reset."""
    payload = _stored_batch(events=16, hashes=64)
    replay = _TailReplay(payload, batches=40)
    ctx = zmq.asyncio.Context()
    sink = _Sink()
    sub = Subscriber(ctx, "tcp://127.0.0.1:1", replay.endpoint, sink, Metrics())
    try:
        got = [await sub.poll_tail() for _ in range(3)]
        held = sum(len(v) for v in sub._replayed.values())
        print(f"payload {len(payload):,} bytes; tail polls recovered {got}; _replayed holds {len(sub._replayed)} "
              f"seqs, {held:,} bytes")
        assert got == [40, 40, 40] and sink.applied == list(range(120))  # control: every batch applied
        assert held <= 120 * 16, f"{held:,} bytes of replayed payloads held after three tail polls"
        # the duplicate check still works: the same batch live is skipped, another one is a reset
        await sub.handle([b"", (100).to_bytes(8, "big"), payload])
        assert sink.invalid == [] and sink.seq == 119
        await sub.handle([b"", (100).to_bytes(8, "big"), _stored_batch(events=1, hashes=1)])
        assert sink.invalid == ["seq_reset"] and sub._replayed == {}
    finally:
        replay.close()
        ctx.term()
