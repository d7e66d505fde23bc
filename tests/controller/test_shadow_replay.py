"""The block-pool shadow follows the replay that rebuilds the index (issue #27, a controller restart or a worker
registered again).

The controller rebuilds a rank's index by replaying its KV events. The shadow of the rank's pool used to be made at
the rank's first route, empty (every block free and unhashed) beside a full index, and events were dropped while it
did not exist: so it predicted no eviction until a pool's worth of new blocks had gone by, and a route decided before
a request's events arrived trusted blocks that request was evicting (the stale WARM routes the shadow exists for).
Now the pool is made at the first event once the capacity is known, and the replay fills it in stored order (each
request's blocks last first, as vLLM frees them). The real Router on a `kvfleet sim-vllm` worker.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.one_worker import complete_direct, synced

from controller.metrics import Metrics
from controller.registry import KvStore
from controller.router import Router, RouterConfig, WorkerSpec
from fleet.app.testkit.sim_vllm.config import SimEngineConfig
from fleet.app.testkit.sim_vllm.main import SimConfig, SimVllm
from fleet.cas import open_store
from fleet.core.block_hash import external_chain

B, NUM_BLOCKS = 16, 64


def _toks(seed: int, num_blocks: int) -> list[int]:
    return [seed * 100_000 + k for k in range(num_blocks * B)]


# six prompts of 10 blocks and one of 4: the stand-in's 64 blocks, the oldest first
FILL = [_toks(i + 1, 10) for i in range(6)] + [_toks(60, 4)]


async def _router(store: KvStore) -> Router:
    r = Router(store, Metrics(), RouterConfig(reconcile_interval_s=0.1))
    await r.start()
    return r


@pytest.mark.parametrize("how", ["controller restarted", "worker registered again"])
async def test_the_replay_that_rebuilds_the_index_fills_the_shadow_in_stored_order(tmp_path: Path, how: str) -> None:
    store = open_store(f"sqlite:///{tmp_path}/kv.db")
    sim = await SimVllm(SimConfig(engine=SimEngineConfig(model="m", num_blocks=NUM_BLOCKS))).start()
    spec = WorkerSpec("w0", sim.url, sim.kv_events, sim.replay, "m")
    r = await _router(store)
    try:
        await r.register_worker(spec)
        for p in FILL:
            await complete_direct(sim, r, p)
        if how == "controller restarted":
            await r.stop()
            r = await _router(store)  # the index is rebuilt by replay from the store's seqs
        else:
            await r.unregister_worker("w0")
            await r.register_worker(spec)  # its publisher's buffer is replayed
        await synced(r, sim)
        key, cfg = ("w0", 0), r.worker("w0").view().hash_cfg
        assert cfg is not None
        chains = [external_chain(cfg, p) for p in FILL]
        assert r.index.num_resident(key) == NUM_BLOCKS
        pool = r.shadow.get(key)
        assert pool is not None  # NOTE: before, None until the rank's first route, and then empty
        # 63 usable blocks here (vLLM's null block): oldest prompt first, each last block first
        assert pool.queue() == [h for c in chains for h in c[::-1]][1:]

        # A extends the newest prompt by 20 blocks: LRU drops the two oldest prompts for it
        a = FILL[-1] + _toks(900, 20)
        da = await r.route(a, "m", track=True)
        assert da.worker == "w0" and da.matched_tokens == 4 * B
        victim = FILL[1]
        dv = await r.route(victim, "m")  # decided before A's events arrive
        assert (dv.verdict, dv.matched_tokens) == ("COLD", 0)  # NOTE: before, WARM with 160 matched
        assert set(chains[1]) <= set(sim.engine.resident_external())  # still there: A has not run yet
        await complete_direct(sim, r, a)
        assert not set(chains[1]) & set(sim.engine.resident_external())  # control: gone where A ran
        assert r.release_route(da.route_id)
    finally:
        await r.stop()
        await sim.stop()
        store.close()


async def test_after_a_replay_lru_is_expected_to_drop_a_prompts_last_blocks_first(tmp_path: Path) -> None:
    """A BlockStored is one request's blocks, and vLLM frees a request's blocks last first: replayed, they queue so.
    Before, they queued head first, and after a restart the shadow expected LRU to drop the oldest prompt's first
    block, hiding all of it, where vLLM drops its last blocks and the prompt's head stays resident."""
    store = open_store(f"sqlite:///{tmp_path}/kv.db")
    sim = await SimVllm(SimConfig(engine=SimEngineConfig(model="m", num_blocks=NUM_BLOCKS))).start()
    r = await _router(store)
    try:
        await r.register_worker(WorkerSpec("w0", sim.url, sim.kv_events, sim.replay, "m"))
        for p in FILL:
            await complete_direct(sim, r, p)
        await r.stop()
        r = await _router(store)
        await synced(r, sim)
        cfg = r.worker("w0").view().hash_cfg
        assert cfg is not None
        a = FILL[-1] + _toks(900, 13)  # 13 new blocks: LRU drops the oldest prompt and 3 of the next
        da = await r.route(a, "m", track=True)
        assert da.worker == "w0"
        await complete_direct(sim, r, a)
        kept = set(sim.engine.resident_external())
        victim = external_chain(cfg, FILL[1])
        assert [h in kept for h in victim] == [True] * 7 + [False] * 3  # its head stays: 112 tokens
        dv = await r.route(FILL[1], "m")
        # NOTE: before, COLD with 0 matched. 96, not 112: the shadow has 63 usable blocks where the stand-in has 64
        assert (dv.verdict, dv.matched_tokens) == ("WARM", 96)
        assert r.release_route(da.route_id)
    finally:
        await r.stop()
        await sim.stop()
        store.close()
