"""A restarted controller's catch-up replays run side by side: one worker's (or rank's) replay that does not answer
holds only its own stream, never another worker's ingestion or the controller's start (regression).

Found by review: Router.start resumed the stored workers one after another, and Worker.start caught its ranks up
one after another, each replay waiting up to its StreamLimits (1 s of silence, 10 s in all). Against replay
endpoints nothing listens on, three registered workers took 2.0 s to resume (1 s per worker or rank whose replay
did not answer, summed): a worker later in the store ingested nothing meanwhile, and a controller leads only once
Router.start returns (with a Redis store its lease is trusted for 8 s of its 10 s ttl: a start that takes longer
loses it and starts over). Real stand-ins (`kvfleet sim-vllm`), a real Router on SQLite, real ZMQ ROUTER sockets
that hold their replay requests until the test lets them go.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import zmq.asyncio
from support.held_replay import HELD, HeldReplay

from controller.metrics import Metrics
from controller.router import Router, RouterConfig, WorkerSpec
from fleet.app.testkit.sim_vllm.config import SimEngineConfig
from fleet.app.testkit.sim_vllm.main import SimConfig, SimVllm
from fleet.cas import open_store


@contextlib.asynccontextmanager
async def _restarted(tmp_path: Path, specs: list[WorkerSpec],
                     held: HeldReplay) -> AsyncIterator[tuple[Router, asyncio.Task[None]]]:
    """`specs` in the store as registered workers; a new Router starting on it (the task that runs Router.start);
    `held` released when the test is done with it."""
    store = open_store(f"sqlite:///{tmp_path}/kv.db")
    cfg = RouterConfig(reconcile_interval_s=0.1, http_timeout_s=10.0, stream=HELD)
    for spec in specs:  # written as register_worker writes them, with no watcher
        Router(store, Metrics(), cfg).registry.put(spec)
    r = Router(store, Metrics(), cfg)
    start = asyncio.get_running_loop().create_task(r.start())
    try:
        yield r, start
    finally:
        held.released.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(start, 30)
        await r.stop()
        store.close()


async def _until(pred, what: str) -> None:  # type: ignore[no-untyped-def]
    for _ in range(500):
        if pred():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(what)


async def test_a_replay_that_does_not_answer_holds_no_other_workers_catch_up(tmp_path: Path) -> None:
    sims = [await SimVllm(SimConfig(engine=SimEngineConfig(model="m", num_blocks=64))).start() for _ in range(2)]
    ctx = zmq.asyncio.Context()
    held = HeldReplay(ctx, 1)
    try:
        specs = [WorkerSpec("a-held", sims[0].url, sims[0].kv_events, held.endpoint, "m"),  # first in the store
                 WorkerSpec("b-good", sims[1].url, sims[1].kv_events, sims[1].replay, "m")]
        async with aiohttp.ClientSession() as h, h.post(sims[1].url + "/v1/completions",
                                                        json={"model": "m", "prompt": list(range(64))}) as resp:
            assert resp.status == 200  # b-good published while no controller watched it: its catch-up replays it
        assert sims[1].publisher is not None and sims[1].publisher.seq >= 1
        async with _restarted(tmp_path, specs, held) as (r, start):
            await _until(lambda: held.requests == 1, "a-held's catch-up replay never asked")

            def good_seq() -> int:
                return max((row.last_seq for row in r.workers() if row.url == sims[1].url), default=-1)

            # before the fix: b-good was not started while a-held's replay was out (held.requests 1, b-good absent)
            await _until(lambda: good_seq() >= sims[1].publisher.seq - 1,  # type: ignore[union-attr]
                         "b-good ingested nothing while a-held's replay was held")
            assert not start.done()  # control: a-held's replay is still held
            held.released.set()
            await asyncio.wait_for(start, 30)
    finally:
        await held.close()
        ctx.term()
        for s in sims:
            await s.stop()


async def test_a_dp_workers_ranks_catch_up_side_by_side(tmp_path: Path) -> None:
    sim = await SimVllm(SimConfig(engine=SimEngineConfig(model="m", num_blocks=64))).start()
    ctx = zmq.asyncio.Context()
    held = HeldReplay(ctx, 3)
    try:
        spec = WorkerSpec("w", sim.url, sim.kv_events, held.endpoint, "m", dp_ranks=3)
        async with _restarted(tmp_path, [spec], held) as (_r, start):
            # before the fix: rank 1 asked only once rank 0's replay had answered (held.requests stayed 1)
            await _until(lambda: held.requests == 3, "the 3 ranks' catch-up replays never all asked at once")
            assert not start.done()
            held.released.set()
            await asyncio.wait_for(start, 30)
    finally:
        await held.close()
        ctx.term()
        await sim.stop()
