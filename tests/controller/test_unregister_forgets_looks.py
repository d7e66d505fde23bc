"""Unregistering a worker drops the /metrics look the route ordering last reconciled its ranks with.

CandidateOrder keeps, per (worker, rank), the look its in-flight ledger was last reconciled with. Nothing dropped
those of an unregistered worker, so a controller whose fleet registers pods under new names kept one entry per pod
it ever routed to, for its life. The real Router on one `kvfleet sim-vllm` stand-in, registered again and again
under new names (the same endpoints) and unregistered each time; the control is the worker that stays.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from support.waits import wait_until

from controller.metrics import Metrics
from controller.router import Router, RouterConfig, WorkerSpec
from fleet.app.testkit.sim_vllm.config import SimEngineConfig
from fleet.app.testkit.sim_vllm.main import SimConfig, SimVllm
from fleet.cas import open_store

NUM_PODS = 5


async def test_unregistered_workers_leave_no_reconciled_look(tmp_path: Path) -> None:
    sim = await SimVllm(SimConfig(engine=SimEngineConfig(model="m", num_blocks=256, time_scale=0.0))).start()
    r = Router(open_store(f"sqlite:///{tmp_path}/kv.db"), Metrics(), RouterConfig(reconcile_interval_s=0.05))
    await r.start()
    looked = r.candidates._looked
    try:
        await r.register_worker(WorkerSpec("w0", sim.url, sim.kv_events, sim.replay, "m"))
        prompts = iter(range(10**6))

        async def route_tracked() -> None:  # a tracked route: the ordering reconciles every candidate's look
            await r.route([next(prompts)] * 40, "m", track=True)

        for i in range(NUM_PODS):
            name = f"pod-{i}"
            await r.register_worker(WorkerSpec(name, sim.url, sim.kv_events, sim.replay, "m"))
            await wait_until(lambda n=name: r.worker(n).load_at is not None, f"a /metrics look of {name}")
            for _ in range(250):  # routes until one has reconciled the new worker's look (once it serves)
                await route_tracked()
                if (name, 0) in looked:
                    break
                await asyncio.sleep(0.02)
            assert (name, 0) in looked
            await r.unregister_worker(name)
        await route_tracked()
        assert ("w0", 0) in looked  # control: the registered worker's look is kept
        assert sorted(looked) == [("w0", 0)]  # before: every pod-i's stayed (5 of 6 entries)
    finally:
        await r.stop()
        await sim.stop()
