"""A /sleep at level 1 while asleep at level 0 discards the KV cache, as vLLM's does, and queues its clear.

vLLM's EngineCore.sleep always pauses with clear_cache = level >= 1 (the prefix cache reset, AllBlocksCleared
queued) and then sleeps the executor, which is a no-op only when its memory is asleep already. The stand-in took
any sleep while asleep for a no-op: after sleep(0) then sleep(1) it kept the cache that vLLM discards, and never
queued the clear the controller's verb waits for, so the worker, woken, stayed COLD for good (fence "clear").
The real Router on a `kvfleet sim-vllm` worker, every verb through the controller.
"""

from __future__ import annotations

from support.one_worker import complete_direct, one_worker, warm

from fleet.core.block_hash import external_chain

BEFORE = list(range(1000, 1100))  # 6 full blocks
AFTER = list(range(2000, 2100))


async def test_sleep_level_1_after_level_0_discards_the_cache_and_the_woken_worker_warms_again(tmp_path) -> None:
    async with one_worker(tmp_path, 64) as (r, sim):
        await complete_direct(sim, r, BEFORE)
        await warm(r, BEFORE)
        await r.lifecycle("w0", "sleep", level=0)
        await r.lifecycle("w0", "sleep", level=1)
        held = set(sim.engine.resident_external())
        assert not held & set(external_chain(r.worker("w0").view().hash_cfg, BEFORE)), "level 1 kept the KV cache"
        assert sim.engine.sleep_state["weights_offloaded"] == 1
        await r.lifecycle("w0", "wake_up")
        await complete_direct(sim, r, AFTER)  # its step publishes the queued AllBlocksCleared, then AFTER's blocks
        assert r.worker("w0").ranks[0].fence == ""
        assert (await r.route(AFTER, "m")).verdict == "WARM" and (await r.route(BEFORE, "m")).verdict == "COLD"
