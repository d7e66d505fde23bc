"""A worker whose block size the controller could not read learns it from the GPU pool's own events, never from a
KV connector's (regression).

Without a block size in the spec, the watcher reads it from the worker (/server_info, /metrics) when it starts, and
failing that (the worker unreachable then: a controller restarted while it was) adopts the first BlockStored's.
Found by review: that was any BlockStored, and vLLM's OffloadingConnector publishes its CPU copies through the same
stream with block_size 0 (0.33) or its own offloaded block size (older releases). A first one of block size 0 raised
out of the batch (HashConfig refuses 0): the batch's seq was never taken, every later message was a gap whose
replay raised again, and the rank ingested nothing more while vLLM's replay buffer held it; one of block size 64
on a pool of 16 was taken for the worker's hashing, every GPU block 0 then failed self-calibration, and the worker
was never WARM. Real stand-in (`kvfleet sim-vllm`, its PUB and replay ROUTER) behind an HTTP front the test takes
down and up, a real Router on SQLite resuming the worker from its store.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from support.http_stub import serving

from controller.metrics import Metrics
from controller.router import Router, RouterConfig, WorkerSpec
from fleet.app.testkit.sim_vllm import wire
from fleet.app.testkit.sim_vllm.config import SimEngineConfig
from fleet.app.testkit.sim_vllm.main import SimConfig, SimVllm
from fleet.cas import open_store
from fleet.core.errors import Unavailable

PROMPT = list(range(1000, 1100))  # 6 full blocks of 16


async def _until(pred, what: str) -> None:  # type: ignore[no-untyped-def]
    for _ in range(500):
        if await pred():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(what)


@pytest.mark.parametrize("offload_block_size", [0, 64])  # 0.33's connector; older ones: the offloaded block size
async def test_a_kv_connectors_event_does_not_set_the_block_size(tmp_path: Path, offload_block_size: int) -> None:
    sim = await SimVllm(SimConfig(engine=SimEngineConfig(model="m", block_size=16, num_blocks=64))).start()
    assert sim.publisher is not None
    up = False

    async def front(req: web.Request) -> web.Response:  # the worker's HTTP, unreachable until `up`
        if not up:
            return web.Response(status=503)
        async with aiohttp.ClientSession() as h, h.request(req.method, sim.url + req.path_qs, data=await req.read(),
                                                           headers={"Content-Type": req.content_type}) as resp:
            return web.Response(body=await resp.read(), status=resp.status, content_type=resp.content_type)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", front)
    store = open_store(f"sqlite:///{tmp_path}/kv.db")
    cfg = RouterConfig(reconcile_interval_s=0.1, http_timeout_s=10.0)
    try:
        async with serving(app) as url:
            Router(store, Metrics(), cfg).registry.put(WorkerSpec("w0", url, sim.kv_events, sim.replay, "m"))
            r = Router(store, Metrics(), cfg)
            await r.start()  # a controller restarted while the worker's HTTP was down: no block size read
            try:
                w = r.worker("w0")
                assert w.hash_cfg is None
                sim.publisher.publish([wire.VllmBlockStored(  # an offloaded copy, first in the stream
                    block_hashes=[1 << 50], parent_block_hash=None, token_ids=[], block_size=offload_block_size,
                    lora_id=None, medium="CPU", lora_name=None)])
                up = True
                async with aiohttp.ClientSession() as h, h.post(url + "/v1/completions", json={"prompt": PROMPT}) as resp:
                    assert resp.status == 200

                async def ingested() -> bool:
                    return w.applied_seq(0) == sim.publisher.seq - 1  # type: ignore[union-attr]

                # before the fix (block size 0): the rank stayed at seq -1, the CPU event's batch raising again
                await _until(ingested, f"the rank never ingested past the offloaded copy (seq {w.ranks[0].seq})")

                async def warm() -> bool:
                    try:
                        return (await r.route(PROMPT, "m")).verdict == "WARM"
                    except Unavailable:  # not serving yet: the first look since it came up is still to come
                        return False

                # before the fix (block size 64): the worker hashed as 64, block 0 failed calibration, never WARM
                await _until(warm, f"never WARM (block size {w.hash_cfg and w.hash_cfg.block_size})")
                assert w.hash_cfg is not None and w.hash_cfg.block_size == 16 and w.calibrated
                # before the fix (block size 0): the batch raised and was taken for a decode error (the rank's index
                # dropped); whether its seq was taken too depended on where the batch had yielded to the loop
                assert not r.metrics.registry.get_sample_value("kvfleet_epoch_bumps_total", {"reason": "decode_error"})
            finally:
                await r.stop()
    finally:
        store.close()
        await sim.stop()
