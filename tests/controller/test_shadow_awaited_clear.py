"""The AllBlocksCleared that a controller verb queued must not make the block-pool shadow forget the routes made
after the verb (issue #27, stale WARM routes through the controller).

The controller drops a rank's index, demand record and shadow when a forgetting verb runs, and routes nothing
there while it runs; vLLM publishes the clear with its next engine step, so it reaches the controller after the
first routes made since. Before the fix that clear was applied to the shadow again: those routes' blocks became
ghosts, their BlockStored events then queued them head first (vLLM frees a request's blocks tail first), and the
shadow predicted LRU evicting the wrong end of a conversation. A clear behind the controller's back is still
applied in full (the control below). The real Router on a `kvfleet sim-vllm` worker.
"""

from __future__ import annotations

import aiohttp
from support.one_worker import complete_direct, one_worker

from fleet.core.block_hash import external_chain

BEFORE = list(range(1000, 1100))  # 6 full blocks
AFTER = list(range(2000, 2100))
LATER = list(range(3000, 3100))


async def test_an_awaited_clear_keeps_the_routes_made_after_the_verb_and_a_clear_behind_its_back_does_not(
    tmp_path,
) -> None:
    async with one_worker(tmp_path, 64) as (r, sim):
        key = ("w0", 0)
        await complete_direct(sim, r, BEFORE)
        assert (await r.route(BEFORE, "m")).verdict == "WARM"

        await r.lifecycle("w0", "reset_prefix_cache")  # the worker is idle: it resets; the clear is queued
        d = await r.route(AFTER, "m", track=True, owner="acme")  # made after the verb, before the clear arrives
        chain = external_chain(r.worker("w0").view().hash_cfg, AFTER)
        pool = r.shadow.get(key)
        assert pool is not None and all(pool.cached(h) and h not in pool.queue() for h in chain)  # held
        await complete_direct(sim, r, AFTER)  # publishes [AllBlocksCleared, BlockStored(AFTER)]
        assert r.metrics.kv_events.labels("AllBlocksCleared")._value.get() == 1
        # still held by the route, not queued as evictable; its conversation still lives here
        assert r.shadow.get(key) is pool and all(pool.cached(h) and h not in pool.queue() for h in chain)
        prev = r.demand.previous(chain)
        assert prev is not None and prev[1].key == key
        assert r.release_route(d.route_id, owner="acme")
        assert pool.queue()[-len(chain):] == chain[::-1]  # freed tail first, as vLLM's KVCacheManager.free

        # control: a reset behind the controller's back is not awaited, and still forgets everything
        async with aiohttp.ClientSession() as h, h.post(sim.url + "/reset_prefix_cache") as resp:
            assert resp.status == 200 and (await resp.json())["success"]
        await complete_direct(sim, r, LATER)
        assert r.metrics.kv_events.labels("AllBlocksCleared")._value.get() == 2
        assert not any(pool.cached(h) for h in chain) and r.demand.previous(chain) is None
        assert (await r.route(AFTER, "m")).verdict == "COLD"
