"""/pause?mode=keep with vLLM's default clear_cache=true resets the prefix cache: the controller must not keep it WARM.

vLLM's /pause docstring says clear_cache is ignored for mode=keep, but its engine (EngineCoreProc.pause_scheduler)
resets the caches once the pause completes in every mode, keep included (reset_running_requests=True: the frozen
requests are preempted, AllBlocksCleared queued). The controller took a pause keep for preserving and the stand-in
ignored the flag for keep: once resumed, the worker was routed WARM to a cache vLLM had just reset (a stale WARM
route, until the clear came with the next step). Only clear_cache=false preserves (the control below).
The real Router on a `kvfleet sim-vllm` worker, every verb through the controller.
"""

from __future__ import annotations

from support.one_worker import complete_direct, one_worker, warm

from fleet.core.block_hash import external_chain

BEFORE = list(range(1000, 1100))  # 6 full blocks
AFTER = list(range(2000, 2100))


async def test_a_pause_keep_with_the_default_clear_cache_forgets_the_cache(tmp_path) -> None:
    async with one_worker(tmp_path, 64) as (r, sim):
        await complete_direct(sim, r, BEFORE)
        chain = set(external_chain(r.worker("w0").view().hash_cfg, BEFORE))
        await warm(r, BEFORE)
        w = await r.lifecycle("w0", "pause", mode="keep")
        assert w.kv == "forgotten" and not chain & set(sim.engine.resident_external())  # vLLM's engine reset it
        await r.lifecycle("w0", "resume")
        assert (await r.route(BEFORE, "m")).verdict == "COLD", "routed WARM to a cache the pause reset"
        await complete_direct(sim, r, AFTER)  # the queued AllBlocksCleared, then AFTER's blocks: the fence lifts
        assert (await r.route(AFTER, "m")).verdict == "WARM"


async def test_a_pause_keep_with_clear_cache_false_keeps_it(tmp_path) -> None:
    async with one_worker(tmp_path, 64) as (r, sim):
        await complete_direct(sim, r, BEFORE)
        await warm(r, BEFORE)
        w = await r.lifecycle("w0", "pause", mode="keep", clear_cache=False)
        assert w.kv == "preserved"
        await r.lifecycle("w0", "resume")
        assert (await r.route(BEFORE, "m")).verdict == "WARM"
