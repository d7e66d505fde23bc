"""An event nested near the recursion limit is a decode error of its batch, at whatever depth it fails (regression).

Found by the KV-event fuzz audit (scripts/fuzz_kv_events.py, then a probe of every depth): the batch is decoded
with its events left raw, then each event on its own; an event of an unknown type is decoded a second time, whole, to
read its tag. An event nested just short of the recursion limit passed the first and raised RecursionError in the
second, which only msgspec's own errors were caught around: in a real Router, an unknown event with a field 984 lists
deep escaped the subscriber as a traceback and its batch's seq was never taken, so with vLLM's replay (10,000 batches
kept) every later message would be a gap whose replay hands back the same batch, which raises again. Where the window
lies depends on the stack the decode runs on, so every depth up to past the limit is tried.
"""

from __future__ import annotations

import msgspec
import pytest
import zmq.asyncio

from controller.metrics import Metrics
from controller.vllm.events import EventDecodeError, decode_batch
from controller.vllm.subscriber import Subscriber

DEPTHS = range(600, 1001)  # the limit is 1000 frames, of which the caller's stack takes some
ENC = msgspec.msgpack.Encoder()


def _deep(depth: int, tag: str = "BlockPinned") -> bytes:
    """A batch of one event of type `tag` whose field `x` is `depth` lists deep."""
    return ENC.encode([1.0, [{"type": tag, "x": msgspec.Raw(b"\x91" * depth + b"\x01")}], 0])


def test_a_deeply_nested_event_is_a_decode_error_at_every_depth() -> None:
    for depth in DEPTHS:
        with pytest.raises(EventDecodeError):  # before the fix: RecursionError at a few depths (993 on a bare stack)
            decode_batch(_deep(depth))
    # control: an event of a known type nested as deep in a field it ignores decodes
    ev = {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU", "x": msgspec.Raw(b"\x91" * 100 + b"\x01")}
    assert decode_batch(ENC.encode([1.0, [ev], 0])).events[0].block_hashes == (7,)


class _Sink:
    def __init__(self) -> None:
        self.seq, self.invalid = -1, []

    def last_seq(self) -> int:
        return self.seq

    def on_batch(self, seq, batch) -> None:  # type: ignore[no-untyped-def]
        self.seq = seq

    def on_invalidate(self, reason, seq) -> None:  # type: ignore[no-untyped-def]
        self.invalid.append((reason, seq))
        self.seq = max(self.seq, -1 if seq is None else seq)  # as the rank state takes it (RankState.stream_invalidated)


async def test_each_deep_batch_is_an_invalidation_at_its_seq_and_the_stream_goes_on() -> None:
    """Through the subscriber (no socket needed: each message is handed in as its frames): every such batch is counted,
    invalidates the rank at its own seq (so the next message is no gap), and raises nothing."""
    ctx = zmq.asyncio.Context()
    m, sink = Metrics(), _Sink()
    sub = Subscriber(ctx, "tcp://127.0.0.1:1", None, sink, m)
    try:
        for seq, depth in enumerate(DEPTHS):
            await sub.handle([b"", seq.to_bytes(8, "big"), _deep(depth)])  # before the fix: RecursionError escaped
        assert [s for _, s in sink.invalid] == list(range(len(DEPTHS)))
        assert {r for r, _ in sink.invalid} <= {"decode_error", "unknown_event_type"}
        assert m.registry.get_sample_value("kvfleet_kv_event_decode_errors_total") == len(DEPTHS)
    finally:
        await sub.stop()
        ctx.term()
