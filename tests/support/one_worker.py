"""The real Router on a fresh SQLite store with one `kvfleet sim-vllm` stand-in registered as w0, its pool size
known (its /metrics read) before the test starts."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from controller.cost import CostConfig
from controller.metrics import Metrics
from controller.router import Router, RouterConfig, WorkerSpec
from fleet.app.testkit.sim_vllm.engine import SimEngineConfig
from fleet.app.testkit.sim_vllm.main import SimConfig, SimVllm
from fleet.cas import open_store


@contextlib.asynccontextmanager
async def one_worker(tmp_path: Path, num_blocks: int,
                     cost: CostConfig | None = None) -> AsyncIterator[tuple[Router, SimVllm]]:
    store = open_store(f"sqlite:///{tmp_path}/kv.db")
    sim = await SimVllm(SimConfig(engine=SimEngineConfig(model="m", num_blocks=num_blocks))).start()
    r = Router(store, Metrics(), RouterConfig(reconcile_interval_s=0.1, cost=cost or CostConfig()))
    await r.start()
    try:
        await r.register_worker(WorkerSpec("w0", sim.url, sim.kv_events, sim.replay, "m"))
        for _ in range(200):
            if r.worker("w0").view().load.num_gpu_blocks:
                break
            await asyncio.sleep(0.02)
        yield r, sim
    finally:
        await r.stop()
        await sim.stop()
        store.close()
