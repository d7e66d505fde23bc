"""A live seq that jumps far ahead is an unrepaired gap that costs the controller what the replay answered, not the
length of the jump (regression).

Found by the KV-event fuzzer (scripts/fuzz_kv_events.py): the gap repair named the first seq the replay lacked with
`min(set(range(last + 1, seq)) - set(got))`, a set of every seq of the gap. One frame whose seq jumped by 2**24 held
the event loop 8 s (every Route and the gRPC server waited), by 2**40 for good, while the set grew until the
controller ran out of memory. vLLM's seq grows by 1, but a seq frame is whatever the worker's socket delivers.
Real ZMQ: the worker's replay ROUTER answers as vLLM's does (it holds none of the gap: just the end marker).
"""

from __future__ import annotations

import tracemalloc

import zmq.asyncio
from support.kv_flood import END, RecordingSink, replay_router

from controller.metrics import Metrics
from controller.vllm.subscriber import Subscriber
from fleet.app.testkit.sim_vllm import wire

PAYLOAD = wire.encode_batch(0.0, [wire.VllmBlockRemoved(block_hashes=[7], medium="GPU")], 0)


async def test_a_far_seq_jump_is_a_gap_that_costs_only_the_replay_answer() -> None:
    asked: list[int] = []

    async def serve(router: zmq.asyncio.Socket) -> None:
        while True:
            ident, _, start = await router.recv_multipart()
            asked.append(int.from_bytes(start, "big"))
            await router.send_multipart([ident, b"", b"", END, b""])

    sink = RecordingSink()
    sink.seq = 5
    async with replay_router(serve) as (ctx, replay):
        sub = Subscriber(ctx, "tcp://127.0.0.1:1", replay, sink, Metrics())  # live frames are handed in below
        try:
            far = 6 + (1 << 20)
            tracemalloc.start()
            try:
                await sub.handle([b"", far.to_bytes(8, "big"), PAYLOAD])
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
            print(f"a jump of 2**20: traced peak {peak / 2**20:.2f} MiB")
            assert asked == [6]  # repair asked from the seq after the last one read
            assert sink.invalid == ["gap"] and sink.applied == [far]  # unrepaired: the rank fails closed, goes on at far
            assert peak < 4 << 20  # before the fix: a set of the 2**20 seqs, 128 MiB traced

            # a jump of 2**62 (still a seq vLLM's int64 counter can hold): before the fix, this never returned
            farther = far + (1 << 62)
            await sub.handle([b"", farther.to_bytes(8, "big"), PAYLOAD])
            assert sink.invalid == ["gap", "gap"] and sink.applied == [far, farther] and asked == [6, far + 1]
        finally:
            await sub.stop()


async def test_a_gap_the_replay_fills_is_applied_in_order() -> None:
    """Control: the same repair with a replay that holds the gap applies it, then the live batch."""

    async def serve(router: zmq.asyncio.Socket) -> None:
        ident, _, _start = await router.recv_multipart()
        for s in (6, 7, 8):
            await router.send_multipart([ident, b"", b"", s.to_bytes(8, "big"), PAYLOAD])
        await router.send_multipart([ident, b"", b"", END, b""])

    sink = RecordingSink()
    sink.seq = 5
    async with replay_router(serve) as (ctx, replay):
        sub = Subscriber(ctx, "tcp://127.0.0.1:1", replay, sink, Metrics())
        try:
            await sub.handle([b"", (9).to_bytes(8, "big"), PAYLOAD])
            assert sink.applied == [6, 7, 8, 9] and sink.invalid == []
        finally:
            await sub.stop()
