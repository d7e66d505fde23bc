"""A catch-up replay whose reply has a hole is applied only up to it (regression).

Found by review: `Subscriber.start` applied every batch a catch-up replay returned, in the order it came, without the
contiguity check the gap repair and the tail poll make. A reply missing a batch between two it holds (a ROUTER that
dropped it on its send high-water mark, or any publisher that does not keep its buffer whole) had the sink skip that
batch's BlockRemoved and AllBlocksCleared: a block evicted there stayed in the index, and routes went WARM to a worker
that no longer held it. Real ZMQ ROUTER and SUB sockets on loopback; the sink records what it is handed.
"""

from __future__ import annotations

import zmq
import zmq.asyncio
from support.kv_flood import END, RecordingSink, replay_router

from controller.metrics import Metrics
from controller.vllm.subscriber import StreamLimits, Subscriber
from fleet.app.testkit.sim_vllm import wire

PAYLOAD = wire.encode_batch(0.0, [wire.VllmBlockRemoved(block_hashes=[7], medium="GPU")], 0)


async def _catch_up(seqs: list[int], start: int = 0) -> tuple[bool, list[int]]:
    """A Subscriber catching up from seq `start` against a replay ROUTER that answers `seqs`, then the end marker: whether
    it says it caught up, and the seqs its sink was handed."""

    async def serve(router: zmq.asyncio.Socket) -> None:
        ident, _, _start = await router.recv_multipart()
        for seq in seqs:
            await router.send_multipart([ident, b"", b"", seq.to_bytes(8, "big"), PAYLOAD])
        await router.send_multipart([ident, b"", b"", END, b""])

    async with replay_router(serve) as (ctx, replay):
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        live = f"tcp://127.0.0.1:{pub.bind_to_random_port('tcp://127.0.0.1')}"
        sink = RecordingSink()
        sub = Subscriber(ctx, live, replay, sink, Metrics(), limits=StreamLimits(replay_timeout_s=5.0))
        try:
            caught_up = await sub.start(catch_up_from=start)
            return caught_up, list(sink.applied)
        finally:
            await sub.stop()
            pub.close(0)


async def test_a_catch_up_stops_at_a_hole_in_the_replay() -> None:
    caught_up, applied = await _catch_up([0, 1, 3, 4])
    assert applied == [0, 1]  # before the fix: [0, 1, 3, 4], seq 2's removals never applied
    assert caught_up is False  # nor counted a whole catch-up (which lifts a fence "clear")


async def test_a_whole_catch_up_is_applied() -> None:
    """Control: a reply with no hole is applied whole, and counts as caught up."""
    assert await _catch_up([0, 1, 2, 3, 4]) == (True, [0, 1, 2, 3, 4])


async def test_a_catch_up_out_of_order_stops_at_the_first_step_back() -> None:
    caught_up, applied = await _catch_up([5, 6, 6, 7])
    assert (caught_up, applied) == (False, [5, 6])


async def test_a_catch_up_stops_at_a_batch_older_than_asked() -> None:
    """vLLM's replay answers seq >= start only; a batch before the start (before the rank's epoch began) is no
    catch-up. Found by the KV-event fuzz audit: they were applied, so an old AllBlocksCleared among them could lift the
    fence "clear" of a sleep the controller drove, and the old stores after it be indexed."""
    caught_up, applied = await _catch_up([3, 4, 5, 6], start=5)
    assert (caught_up, applied) == (False, [])  # before the fix: (True, [3, 4, 5, 6])
    assert await _catch_up([5, 6], start=5) == (True, [5, 6])  # control: from the start asked
    assert await _catch_up([7, 8], start=5) == (True, [7, 8])  # and a suffix of the stream, as before
