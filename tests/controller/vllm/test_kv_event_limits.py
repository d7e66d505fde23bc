"""Impossible KV-event seqs are refused at the edge and never poison a worker (regressions)."""

from __future__ import annotations

import asyncio
import json

import pytest
import zmq
import zmq.asyncio
from support.kv_flood import RecordingSink

from controller.metrics import Metrics
from controller.vllm.events import END_SEQ, MAX_SEQ, EventDecodeError, parse_seq
from controller.vllm.subscriber import Subscriber
from fleet.core.rank_state import RankState


def test_parse_seq_refuses_seqs_no_vllm_sends() -> None:
    assert parse_seq(MAX_SEQ.to_bytes(8, "big")) == MAX_SEQ  # control: the largest legal seq parses
    for bad in (MAX_SEQ + 1, END_SEQ):
        with pytest.raises(EventDecodeError, match="outside vLLM's range"):
            parse_seq(bad.to_bytes(8, "big"))
    assert parse_seq(END_SEQ.to_bytes(8, "big"), allow_end=True) == END_SEQ  # the replay end marker


async def test_a_frame_with_seq_2_64_minus_1_is_dropped_and_the_stream_goes_on() -> None:
    """Regression: such a frame used to be applied; seq + 1 then overflowed int64 everywhere."""
    from fleet.app.testkit.sim_vllm import wire

    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    sink = RecordingSink()
    sub = Subscriber(ctx, f"tcp://127.0.0.1:{port}", None, sink, Metrics())
    await sub.start()
    payload = wire.encode_batch(0.0, [])
    try:
        for _ in range(50):  # PUB/SUB joins asynchronously: send seq 0 until it lands
            await pub.send_multipart([b"", (0).to_bytes(8, "big"), payload])
            await asyncio.sleep(0.02)
            if sink.applied:
                break
        await pub.send_multipart([b"", END_SEQ.to_bytes(8, "big"), payload])
        await pub.send_multipart([b"", (1).to_bytes(8, "big"), payload])
        for _ in range(100):
            await asyncio.sleep(0.02)
            if 1 in sink.applied:
                break
    finally:
        await sub.stop()
        pub.close(0)
        ctx.term()
    print("applied:", sorted(set(sink.applied)), "invalidations:", sink.invalid)
    assert END_SEQ not in sink.applied and 1 in sink.applied and sink.seq == 1
    assert "decode_error" in sink.invalid  # the bad frame was seen and fails closed


async def test_replay_from_an_impossible_seq_fails_without_raising() -> None:
    ctx = zmq.asyncio.Context()
    sub = Subscriber(ctx, "tcp://127.0.0.1:1", "tcp://127.0.0.1:1", RecordingSink(), Metrics())
    try:
        assert await sub.replay(1 << 64) is None  # used to raise OverflowError in Subscriber.start
    finally:
        ctx.term()


def test_a_corrupt_persisted_seq_reads_as_a_fresh_untrusted_stream() -> None:
    good = RankState(epoch=3, seq=41, epoch_seq=40, serving=True)
    assert RankState.from_json(json.loads(json.dumps(good.to_json()))) == good  # control
    bad = dict(good.to_json(), seq=(1 << 64) - 1)
    st = RankState.from_json(bad)
    assert (st.epoch, st.seq, st.epoch_seq, st.serving) == (3, -1, 0, False)
