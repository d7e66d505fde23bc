"""A worker serving one shared prefix's conversations (a tenant's system prompt) counts another's missing prefix at
`mixed_prefix_weight` (issue #27, tenants2: 2 tenants' agents over 4 workers; by load alone every worker
prefilled both system prompts, 8 prefills where 4 keep the load even and sglang-router's cache_aware made 2).

The real Router on four `kvfleet sim-vllm` workers; 16 conversations of two tenants, alternating, each a 1,536-token
system prompt and 40 tokens of its own, routed and tracked (nothing runs: the routes in flight are the evidence).
"""

from __future__ import annotations

import pytest
from support.stand_ins import capacities_known

from controller.cost import CostConfig
from controller.demand import DemandLedger
from controller.metrics import Metrics
from controller.router import Router, RouterConfig, WorkerSpec
from fleet.app.testkit.sim_vllm.config import SimEngineConfig
from fleet.app.testkit.sim_vllm.main import SimConfig, SimVllm
from fleet.cas import open_store

SYSTEM = list(range(1, 1537))  # 96 full blocks


async def _placed(path: str, cost: CostConfig) -> dict[str, list[str]]:
    """Each tenant's conversations' workers, in routing order."""
    sims = [await SimVllm(SimConfig(engine=SimEngineConfig(model="m", num_blocks=2426))).start() for _ in range(4)]
    r = Router(open_store(f"sqlite:///{path}"), Metrics(), RouterConfig(reconcile_interval_s=0.5, cost=cost))
    await r.start()
    try:
        for i, s in enumerate(sims):
            await r.register_worker(WorkerSpec(f"w{i}", s.url, s.kv_events, s.replay, "m"))
        await capacities_known(r)
        out: dict[str, list[str]] = {"t0": [], "t1": []}
        for k in range(16):
            tenant = f"t{k % 2}"
            d = await r.route(SYSTEM + [100_000 * (k + 1) + i for i in range(40)], "m", track=True,
                              cache_salt=tenant, owner=tenant)
            out[tenant].append(d.worker)
        print(cost, out)
        return out
    finally:
        await r.stop()
        for s in sims:
            await s.stop()


@pytest.mark.parametrize("cost", [CostConfig(), CostConfig(mixed_prefix_weight=1.0)], ids=["defaults", "weight_1"])
async def test_each_tenants_system_prompt_is_prefilled_on_two_workers_not_four(tmp_path, cost: CostConfig) -> None:
    out = await _placed(f"{tmp_path}/kv.db", cost)
    t0, t1 = set(out["t0"]), set(out["t1"])
    assert len(t0) == len(t1) == 2 and not t0 & t1  # 4 prefills of a system prompt, not 8
    assert sorted(out["t0"] + out["t1"]).count("w0") == 4  # and the load still even: 4 conversations a worker
    assert {w: (out["t0"] + out["t1"]).count(w) for w in t0 | t1} == {w: 4 for w in t0 | t1}


@pytest.mark.parametrize("cost", [CostConfig(inflight_prefix=False, mixed_prefix_weight=0.0),
                                  CostConfig(mixed_prefix_weight=0.0)], ids=["both_off", "inflight_prefix_alone"])
async def test_control_without_the_weight_every_worker_prefills_both(tmp_path, cost: CostConfig) -> None:
    out = await _placed(f"{tmp_path}/kv.db", cost)
    # by load: each tenant on (nearly) every worker, 7 system prompt prefills in both runs here
    assert len(set(out["t0"])) + len(set(out["t1"])) >= 6


def test_the_ledger_knows_which_ranks_serve_another_first_block() -> None:
    d, w0, w1 = DemandLedger(ttl_s=60), ("w0", 0), ("w1", 0)
    d.place(w0, [1, 2, 3], 2, 0.0, group=2)
    d.place(w1, [7, 8], 0, 0.0, group=99)
    assert d.serves_other_prefix(w0, root=7) and not d.serves_other_prefix(w0, root=1)
    assert not d.serves_other_prefix(("w2", 0), root=1)  # a rank with no conversation serves none
    d.place(w0, [1, 2, 3, 4], 2, 1.0, group=2)  # its next turn: the record moves along, same first block
    assert d.serves_other_prefix(w0, root=7) and not d.serves_other_prefix(w0, root=1)
    d.place(w1, [1, 2, 3, 4, 5], 2, 2.0, group=2)  # the turn after runs on w1: w0 keeps none
    assert not d.serves_other_prefix(w0, root=7) and d.serves_other_prefix(w1, root=1)
    d.forget_rank(w1)  # a cache loss: its records leave
    assert not d.serves_other_prefix(w1, root=1)
