"""The size at which a worker's untracked waiting requests count (controller/inflight.py InFlight.mean_tokens).

It was one running mean for every rank, moved by every tenant's tracked routes when they were decided, sent
or not: one tenant could price every other worker's queue. Now it is kept per rank and moved only by tracked
routes a /metrics look saw that rank schedule.
"""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp

from controller.cost import CandidateState, CostConfig, terms
from controller.inflight import Flight, InFlight
from controller.metrics import Metrics
from controller.router import Router, RouterConfig, WorkerSpec
from fleet.app.testkit.sim_vllm.config import SimEngineConfig
from fleet.app.testkit.sim_vllm.main import SimConfig, SimVllm
from fleet.cas import open_store
from fleet.core.block_hash import external_chain

CFG = CostConfig()
B = 16


def _rid(i: int) -> str:
    return f"{i:032x}"


def test_only_routes_a_rank_was_seen_to_schedule_move_that_ranks_mean() -> None:
    fl = InFlight(120.0, 0.25, 256)
    # another tenant's tracked routes on both ranks, released before any look: never seen to run anywhere
    for i in range(64):
        fl.add(Flight(_rid(i), (f"w{i % 2}", 0), 8192, None, "attacker", 0.0))
        assert fl.release(_rid(i), "attacker") is not None
    assert (fl.mean_tokens(("w0", 0)), fl.mean_tokens(("w1", 0))) == (256.0, 256.0)
    # w0 is seen running two tracked routes of 100 and 300 tokens: w0's mean is theirs, w1 keeps the default
    fl.add(Flight(_rid(100), ("w0", 0), 100, None, "victim", 0.0))
    fl.add(Flight(_rid(101), ("w0", 0), 300, None, "victim", 0.0))
    assert fl.reconcile(("w0", 0), num_running=2, num_waiting=0, polled_at=1.0) == []
    assert (fl.mean_tokens(("w0", 0)), fl.mean_tokens(("w1", 0))) == (200.0, 256.0)
    # a later look that sees them again counts neither twice; one still waiting is not counted yet
    fl.add(Flight(_rid(102), ("w0", 0), 5000, None, "victim", 1.5))
    assert fl.reconcile(("w0", 0), num_running=2, num_waiting=1, polled_at=2.0) == []
    assert fl.mean_tokens(("w0", 0)) == 200.0 and fl.load(("w0", 0)) == (3, 1, 5000)
    # the worker unregistered: a registration of the same name starts from the default
    fl.drop_worker("w0")
    assert fl.mean_tokens(("w0", 0)) == 256.0


def test_each_candidate_prices_untracked_waiting_requests_at_its_own_mean() -> None:
    s = CandidateState("w0", 0, True, True, B, 0, num_running=1.0, num_waiting=3.0)
    assert terms(CFG, 100, s, 256).queued_tokens == 3 * 256  # the caller's default where the state names none
    assert terms(CFG, 100, s._replace(mean_request_tokens=40.0), 256).queued_tokens == 3 * 40


async def _post(url: str, toks: list[int], max_tokens: int) -> None:
    async with aiohttp.ClientSession() as h, h.post(url + "/v1/completions",
                                                    json={"prompt": toks, "max_tokens": max_tokens}) as resp:
        assert resp.status == 200
        await resp.read()


async def test_another_tenants_unsent_tracked_routes_do_not_send_a_warm_prompt_cold(tmp_path) -> None:
    # w0 decodes one request at a time (8 s each here), so untracked requests sent to it straight wait there
    slow = SimEngineConfig(model="m", num_blocks=1024, time_scale=1.0, max_num_seqs=1, decode_base_s=0.02)
    s0 = await SimVllm(SimConfig(engine=slow)).start()
    s1 = await SimVllm(SimConfig(engine=SimEngineConfig(model="m", num_blocks=1024))).start()
    store = open_store(f"sqlite:///{tmp_path}/kv.db")
    r = Router(store, Metrics(), RouterConfig(reconcile_interval_s=0.1))
    await r.start()
    load: list[asyncio.Task[None]] = []
    try:
        for i, s in enumerate((s0, s1)):
            await r.register_worker(WorkerSpec(f"w{i}", s.url, s.kv_events, s.replay, "m"))
        victim = [500_000 + k for k in range(640)]  # 40 blocks, warm on w0 only
        await _post(s0.url, victim, 1)
        for _ in range(300):
            cfg = r.worker("w0").view().hash_cfg
            if cfg is not None and r.index.match(("w0", 0), external_chain(cfg, victim)) == 40:
                break
            await asyncio.sleep(0.01)
        # another tenant: 8 tracked 8,192-token Routes, released at once, never sent
        for i in range(8):
            x = await r.route([1_000_000 * (i + 1) + k for k in range(8192)], "m", owner="attacker", track=True)
            assert r.release_route(x.route_id, owner="attacker")
        # untracked load on w0: 1 running, 2 waiting
        load = [asyncio.create_task(_post(s0.url, [300_000 * (i + 1) + k for k in range(32)], 400)) for i in range(3)]
        for _ in range(300):
            m = r.worker("w0").view().load
            if (m.running, m.waiting) == (1.0, 2.0):
                break
            await asyncio.sleep(0.01)
        d = await r.route(victim, "m", owner="victim")
        by_worker = {c.worker: c.cost for c in d.candidates}
        # w0: 0 prefill + 0.25 x (2 waiting x 256, the default: w0 was never seen to run a tracked route) + 16 x 3;
        # before, the attacker's Routes priced them at 8,192 each (queued 16,384, total 4,144) and w1 (640) won COLD
        assert by_worker["w0"] is not None and by_worker["w0"].queued_tokens == 512
        assert (d.worker, d.verdict, d.matched_tokens, d.cost.total) == ("w0", "WARM", 640, 176)
    finally:
        for t in load:
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        await r.stop()
        for s in (s0, s1):
            await s.stop()
        store.close()
