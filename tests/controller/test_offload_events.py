"""A KV connector's events (vLLM's OffloadingConnector, CPU tier) leave the GPU index and the worker's warmth alone.

vLLM's OffloadingConnector publishes the blocks it offloads through the same batches as the GPU pool, as
`BlockStored(block_hashes, parent_block_hash=None, token_ids=[], block_size=0, medium="CPU", lora_name=None)`
(older releases: block_size = the offloaded block size). Such an event used to go through self-calibration as a
parentless block 0 with no tokens, fail it, drop the rank's index and keep the worker uncalibrated: every warm
prompt routed COLD after the first offload. The real Router on a `kvfleet sim-vllm` worker, the events on its PUB.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from support.one_worker import one_worker

from controller.router import Router
from fleet.app.testkit.sim_vllm import wire
from fleet.app.testkit.sim_vllm.main import SimVllm
from fleet.core.block_hash import external_chain

PROMPT = list(range(1000, 1100))  # 6 full blocks


async def _ingested(sim: SimVllm, r: Router) -> None:
    for _ in range(300):
        await asyncio.sleep(0.01)
        if all(s.last_seq >= sim.publisher.seq - 1 for s in r.workers() if s.url == sim.url):
            return
    raise AssertionError("the router never ingested the worker's events")


@pytest.mark.parametrize("block_size", [0, 16, 64])  # 0.33's connector; older ones: the offloaded block size
async def test_offloaded_blocks_keep_the_gpu_index_and_calibration(tmp_path, block_size: int) -> None:
    async with one_worker(tmp_path, 64) as (r, sim):
        async with aiohttp.ClientSession() as h, h.post(sim.url + "/v1/completions", json={"prompt": PROMPT}) as resp:
            assert resp.status == 200
        await _ingested(sim, r)
        w = r.worker("w0")
        assert (await r.route(PROMPT, "m")).verdict == "WARM"  # control: the GPU pool's own events prove it
        epoch = w.ranks[0].epoch
        offloaded = external_chain(w.view().hash_cfg, PROMPT)[:4]
        assert sim.publisher is not None
        sim.publisher.publish([
            wire.VllmBlockStored(block_hashes=offloaded, parent_block_hash=None, token_ids=[], block_size=block_size,
                                 lora_id=None, medium="CPU", lora_name=None),
            wire.VllmBlockRemoved(block_hashes=offloaded[:1], medium="CPU"),
        ])
        await _ingested(sim, r)
        d = await r.route(PROMPT, "m")
        assert w.calibrated and w.ranks[0].epoch == epoch, "a connector's event failed self-calibration"
        assert d.verdict == "WARM" and r.index.num_blocks(("w0", 0)) == 6 + 3  # GPU blocks, and the CPU copies
