"""A slow or flooding replay endpoint costs bounded time and memory, and never freezes the
reconcile that notices a worker slept behind the controller's back (issue #13 item 7; regressions).

The peer here is a real ZMQ ROUTER that answers replay requests the way a hostile or broken
publisher would: one batch at a time just under the per-frame timeout (trickle), or as fast as
it can without an end marker (flood).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import zmq
import zmq.asyncio
from support.kv_flood import live_stream

from controller.metrics import Metrics
from controller.router import Router, RouterConfig, WorkerSpec
from controller.vllm.subscriber import StreamLimits, Subscriber
from fleet.app.testkit.sim_vllm import wire
from fleet.app.testkit.sim_vllm.config import SimEngineConfig
from fleet.app.testkit.sim_vllm.main import SimConfig, SimVllm
from fleet.cas import open_store
from fleet.core.block_hash import HashConfig, external_chain
from fleet.core.errors import InvalidArgument

PAYLOAD = wire.encode_batch(0.0, [])


class _Sink:
    def last_seq(self) -> int:
        return -1

    def on_batch(self, seq, batch) -> None:  # type: ignore[no-untyped-def]
        pass

    def on_invalidate(self, reason, seq) -> None:  # type: ignore[no-untyped-def]
        pass


@contextlib.asynccontextmanager
async def _bad_replay(ctx: zmq.asyncio.Context, pace_s: float) -> AsyncIterator[str]:
    """A replay ROUTER that never sends the end marker: a batch every `pace_s` (0: flood)."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    streams: list[asyncio.Task[None]] = []

    async def stream(ident: bytes, start: int) -> None:
        seq = start
        while True:
            await sock.send_multipart([ident, b"", b"", seq.to_bytes(8, "big"), PAYLOAD])
            seq += 1
            await asyncio.sleep(pace_s)

    async def serve() -> None:
        while True:
            ident, _, start = await sock.recv_multipart()
            streams.append(asyncio.get_running_loop().create_task(stream(ident, int.from_bytes(start, "big"))))

    server = asyncio.get_running_loop().create_task(serve())
    try:
        yield f"tcp://127.0.0.1:{port}"
    finally:
        for t in [server, *streams]:
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t
        sock.close(0)


def test_stream_limits_refuse_nonsense() -> None:
    with pytest.raises(InvalidArgument, match="replay_deadline_s must be > 0"):
        StreamLimits(replay_deadline_s=0)
    with pytest.raises(InvalidArgument, match="replay_max_bytes must be a positive int"):
        StreamLimits(replay_max_bytes=-1)


@pytest.mark.parametrize("pace_s,limits", [
    (0.0, StreamLimits(replay_max_batches=200)),                       # flood: the batch cap stops it
    (0.0, StreamLimits(replay_max_bytes=len(PAYLOAD) * 100)),         # flood: the byte cap stops it
    (0.05, StreamLimits(replay_timeout_s=1.0, replay_deadline_s=0.5)),  # trickle: the deadline stops it
])
async def test_a_replay_that_never_ends_is_abandoned(pace_s: float, limits: StreamLimits) -> None:
    ctx = zmq.asyncio.Context()
    m = Metrics()
    try:
        async with _bad_replay(ctx, pace_s) as ep:
            sub = Subscriber(ctx, "tcp://127.0.0.1:1", ep, _Sink(), m, limits=limits)
            got = await asyncio.wait_for(sub.replay(0), 30)  # NOTE: used to never return
    finally:
        ctx.term()
    assert got is None  # fails like an unanswered replay: the gap stays unrepaired, the rank cold
    assert m.registry.get_sample_value("kvfleet_kv_event_replays_total", {"outcome": "over_limit"}) == 1


async def test_a_stuck_replay_does_not_hide_a_worker_slept_behind_the_back(tmp_path: Path) -> None:
    """w0's replay endpoint trickles forever; /sleep sent to w0 directly must still stop its routes."""
    sims = [await SimVllm(SimConfig(engine=SimEngineConfig(model="m", num_blocks=64))).start() for _ in range(2)]
    ctx = zmq.asyncio.Context()
    store = open_store(f"sqlite:///{tmp_path}/kv.db")
    cfg = RouterConfig(reconcile_interval_s=0.05, stream=StreamLimits(replay_timeout_s=1.0, replay_deadline_s=2.0))
    r = Router(store, Metrics(), cfg)
    await r.start()
    try:
        async with _bad_replay(ctx, 0.05) as ep:
            await asyncio.wait_for(r.register_worker(WorkerSpec("w0", sims[0].url, sims[0].kv_events, ep, "m")), 30)
            await r.register_worker(WorkerSpec("w1", sims[1].url, sims[1].kv_events, sims[1].replay, "m"))
            for _ in range(200):
                if all(s.serving for s in r.workers()):
                    break
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.3)  # the tail loop is now inside w0's never-ending replay
            async with aiohttp.ClientSession() as h, h.post(sims[0].url + "/sleep", params={"level": "1"}) as resp:
                assert resp.status == 200
            for _ in range(250):  # the reconcile loop looks every 50 ms, whatever the replay is doing
                if not r.worker("w0").ranks[0].serving:
                    break
                await asyncio.sleep(0.02)
            routed = [(await r.route(list(range(i, i + 40)), "m")).worker for i in range(40)]
    finally:
        await r.stop()
        store.close()
        ctx.term()
        for s in sims:
            await s.stop()
    assert routed.count("w0") == 0, f"{routed.count('w0')} of 40 routes went to a sleeping worker"


async def test_a_rank_claiming_more_blocks_than_it_holds_is_refused(tmp_path: Path) -> None:
    """The worker's pool holds 64 blocks (its /metrics says so); a stream claiming 5,000 is refused."""

    def stored(n: int, first_token: int) -> bytes:
        toks = list(range(first_token, first_token + 16 * n))
        hashes = external_chain(HashConfig("sha256", None, 16), toks)  # honest hashes: calibration passes
        ev = wire.VllmBlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=toks,
                                  block_size=16, lora_id=None, medium="GPU", lora_name=None, group_idx=0)
        return wire.encode_batch(0.0, [ev])

    async with live_stream(tmp_path, num_blocks=64) as live:
        assert live.r.worker("w0").load.num_gpu_blocks == 64
        await live.send_payload(stored(10, 1))  # control: 10 blocks fit
        assert live.blocks() == 10
        await live.send_payload(stored(5000, 10_000))
        assert live.blocks() == 10  # the 5,000-block claim was not indexed
        assert live.value("kvfleet_kv_blocks_refused_total") == 5000
