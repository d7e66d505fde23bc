"""The stand-in records when it published an AllBlocksCleared (`SimVllm.cleared_at`): with its next engine step, as
vLLM does, not when the reset answered. The routing bench reads it to tell a stale route that raced a reset behind
the routers' backs from one a router could have avoided (bench/peers/summary.py stale_raced)."""

from __future__ import annotations

import time

import aiohttp

from fleet.app.testkit.sim_vllm.config import SimEngineConfig
from fleet.app.testkit.sim_vllm.main import SimConfig, SimVllm


async def test_a_reset_is_recorded_when_its_event_goes_out_with_the_next_step() -> None:
    s = await SimVllm(SimConfig(engine=SimEngineConfig(model="m", num_blocks=8))).start()
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(s.url + "/v1/completions", json={"prompt": list(range(32)), "max_tokens": 1}) as r:
                assert r.status == 200
            assert not s.cleared_at                            # control: a step that stored blocks is no reset
            async with http.post(s.url + "/reset_prefix_cache") as r:
                assert (await r.json())["success"]
            assert not s.cleared_at                            # queued: nothing published yet
            before = time.monotonic()
            async with http.post(s.url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1}) as r:
                assert r.status == 200
            assert len(s.cleared_at) == 1 and s.cleared_at[0] >= before
    finally:
        await s.stop()
