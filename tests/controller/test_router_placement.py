"""Placement that earns each term from what it observes (issue #27): one-shot requests do not inflate a
worker's working set, a fully resident prompt is never charged for evicting, and a cache loss empties
the rank's demand. The real Router on `kvfleet sim-vllm` workers (64 blocks of 16 tokens each), then
the pure cost model under load with its crossover."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp
from support.stand_ins import capacities_known

from controller.cost import CandidateState, CostConfig, order
from controller.demand import DemandLedger
from controller.metrics import Metrics
from controller.router import Router, RouterConfig, WorkerSpec
from fleet.app.testkit.sim_vllm.config import SimEngineConfig
from fleet.app.testkit.sim_vllm.main import SimConfig, SimVllm
from fleet.cas import open_store
from fleet.core.block_hash import external_chain

B, NUM_BLOCKS, N_ONE_SHOTS = 16, 64, 8
PROMPT = 160  # tokens: 10 full blocks


def one_shot(i: int) -> list[int]:
    return [10_000 * (i + 1) + k for k in range(PROMPT)]


async def _sim() -> SimVllm:
    return await SimVllm(SimConfig(engine=SimEngineConfig(model="m", num_blocks=NUM_BLOCKS))).start()


async def _run(r: Router, sim: SimVllm, name: str, toks: list[int]) -> None:
    """Run the prompt on the worker and wait until the router's index holds its blocks."""
    async with (
        aiohttp.ClientSession() as h,
        h.post(sim.url + "/v1/completions", json={"prompt": toks}) as resp,
    ):
        assert resp.status == 200
    for _ in range(300):
        cfg = r.worker(name).view().hash_cfg
        if cfg is not None and r.index.match((name, 0), external_chain(cfg, toks)) >= len(toks) // B:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{name} never indexed the prompt")


@contextlib.asynccontextmanager
async def _w0_then_w1(path: str) -> AsyncIterator[tuple[Router, SimVllm, SimVllm]]:
    """A Router with w0 registered (64 blocks) and its stand-ins w0, w1: the test registers w1 when it is ready."""
    store = open_store(f"sqlite:///{path}")
    s0, s1 = await _sim(), await _sim()
    r = Router(store, Metrics(), RouterConfig(reconcile_interval_s=0.1))
    await r.start()
    try:
        await r.register_worker(WorkerSpec("w0", s0.url, s0.kv_events, s0.replay, "m"))
        yield r, s0, s1
    finally:
        await r.stop()
        await s0.stop()
        await s1.stop()


async def test_a_fully_resident_prompt_goes_warm_to_its_holder_after_one_shots(tmp_path) -> None:
    """8 distinct one-shot prompts (80 blocks) ran on w0 (64 blocks): LRU kept the last ones. The last
    prompt, fully resident on w0, is routed again with an empty w1 beside it and no load anywhere.
    Before issue #27 it went COLD to w1: w0's working set counted every one-shot (80 > 64 blocks),
    and the excess was charged as eviction to a request that adds no block."""
    async with _w0_then_w1(f"{tmp_path}/kv.db") as (r, s0, s1):
        for i in range(N_ONE_SHOTS):
            d = await r.route(one_shot(i), "m")
            assert d.worker == "w0"
            await _run(r, s0, "w0", one_shot(i))
        await r.register_worker(WorkerSpec("w1", s1.url, s1.kv_events, s1.replay, "m"))
        await capacities_known(r)  # both workers' capacities (vllm:cache_config_info) looked at
        d = await r.route(one_shot(N_ONE_SHOTS - 1), "m")
        print(d.worker, d.verdict, [(c.worker, c.cost) for c in d.candidates])
        assert (d.worker, d.verdict, d.matched_tokens) == ("w0", "WARM", PROMPT)
        assert d.cost is not None and d.cost.evicted_tokens == 0


async def test_a_cache_loss_empties_the_ranks_working_set(tmp_path) -> None:
    """A 4-turn conversation on w0 earns demand there (its turns came back); the worker's prefix cache
    is reset behind the router's back: the AllBlocksCleared empties w0's demand. Before issue #27 the
    ledger kept it until the conversation's TTL (600 s)."""
    store = open_store(f"sqlite:///{tmp_path}/kv.db")
    s0 = await _sim()
    r = Router(store, Metrics(), RouterConfig(reconcile_interval_s=0.1))
    await r.start()
    try:
        await r.register_worker(WorkerSpec("w0", s0.url, s0.kv_events, s0.replay, "m"))
        toks: list[int] = []
        for t in range(4):
            toks = toks + [500 * (t + 1) + k for k in range(48)]
            await r.route(toks, "m")
            await _run(r, s0, "w0", toks)
        assert r.demand.demand(("w0", 0)) > 0
        async with aiohttp.ClientSession() as h:
            async with h.post(s0.url + "/reset_prefix_cache") as resp:
                assert resp.status == 200
            # NOTE: as in vLLM, the AllBlocksCleared is queued and published with the next engine step
            async with h.post(s0.url + "/v1/completions", json={"prompt": [1, 2, 3]}) as resp:
                assert resp.status == 200
        for _ in range(300):
            if not r.index.num_resident(("w0", 0)):
                break
            await asyncio.sleep(0.01)
        assert r.index.num_resident(("w0", 0)) == 0
        assert r.demand.demand(("w0", 0)) == 0 and len(r.demand) == 0
    finally:
        await r.stop()
        await s0.stop()


def test_under_load_a_fully_resident_prompt_stays_until_the_queue_crossover() -> None:
    """The same 8 one-shots on w0 (capacity 64 blocks), now with work queued on w0 and none on w1. A
    fully resident 160-token prompt costs on w0 0.25 x queued + 16 (one active request) and on w1 its
    160-token prefill: it stays WARM while queued < 576 tokens and moves past it. Before issue #27 w0
    also paid the one-shots' 16-block excess (256 tokens): it moved at any queue, even 0."""
    ws = DemandLedger()
    chains = [[7_000 * (i + 1) + k for k in range(PROMPT // B)] for i in range(N_ONE_SHOTS)]
    for c in chains:
        ws.place(("w0", 0), c, 0, 0.0)
    prev = ws.previous(chains[-1])
    assert prev is not None
    need = ws.demand_with(("w0", 0), prev[1], PROMPT // B, 0)

    def best(queued: int) -> tuple[str, int]:
        w0 = CandidateState(
            "w0",
            0,
            True,
            True,
            B,
            PROMPT,
            1,
            1,
            queued,
            num_resident_blocks=NUM_BLOCKS,
            num_gpu_blocks=NUM_BLOCKS,
            num_demand_blocks=need,
        )
        w1 = CandidateState(
            "w1",
            0,
            True,
            True,
            B,
            0,
            num_resident_blocks=0,
            num_gpu_blocks=NUM_BLOCKS,
            num_demand_blocks=PROMPT // B,
        )
        top = order(CostConfig(), PROMPT, [w0, w1], 256.0)[0]
        return top.state.worker, top.terms.evicted_tokens

    assert best(0) == ("w0", 0)
    assert best(512) == ("w0", 0)  # 0.25 x 512 + 16 = 144 < 160
    assert best(640)[0] == "w1"  # 0.25 x 640 + 16 = 176 > 160


async def test_another_tenants_returning_conversations_do_not_reweigh_mine(tmp_path) -> None:
    """Conversations that continue no shared prefix pool their return evidence per tenant. Tenant a ran ten
    one-shots and a conversation's first turn on w0 (64 blocks); w1 is empty. Tenant h then routes 100
    two-turn conversations (200 Routes, never sent). Before, all of them shared one evidence group, h's
    returns raised the rate at which a's one-shots were weighed from 0.00 to 0.94, w0 looked
    over-committed, and a's next turn went COLD to w1. Now it stays WARM on w0, as with no h."""
    from controller.ordering import solo_group

    x1 = [900_000 + k for k in range(80)]
    x2 = x1 + [950_000 + k for k in range(48)]
    outcome = {}
    for flood in (False, True):
        async with _w0_then_w1(f"{tmp_path}/kv{flood}.db") as (r, s0, s1):
            for toks in [one_shot(i) for i in range(10)] + [x1]:
                await r.route(toks, "m", owner="a")
                await _run(r, s0, "w0", toks)
            await r.register_worker(WorkerSpec("w1", s1.url, s1.kv_events, s1.replay, "m"))
            await capacities_known(r)
            if flood:
                for j in range(100):
                    h1 = [3_000_000 + 100 * j + k for k in range(32)]
                    await r.route(h1, "m", owner="h")
                    await r.route(h1 + [5_000_000 + k for k in range(16)], "m", owner="h")
            rate = r.demand.evidence.rate((solo_group("a"), 0))
            d = await r.route(x2, "m", owner="a")
            outcome[flood] = (d.worker, d.verdict, rate)
    print(f"a's next turn and a's one-shot return rate: without h {outcome[False]}, after h's Routes {outcome[True]}")
    assert outcome[True] == outcome[False] and outcome[False][:2] == ("w0", "WARM")   # NOTE: before, ("w1", "COLD")
    assert r.demand.evidence.rate((solo_group("h"), 0)) > 0.9                          # control: h's own rate rose
