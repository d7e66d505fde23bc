"""A draining reset between its asks when its worker is unregistered, or the controller's router stops.

The drain asks vLLM again every 20 ms while the worker's requests finish (tests/controller/test_reset_drain.py);
a stopping worker ends it at the next ask. Unregistered, the verb answered FAILED_PRECONDITION. Stopped with the
router (a controller that steps down as leader stops it while its gRPC server goes on), the drain's end went on to
read /is_sleeping on the router's closed HTTP session, and the caller got `RuntimeError: Session is closed` (gRPC
INTERNAL). Now both answer FailedPrecondition, nothing more is asked, and the rank is left in neither state.
The real Router on two `kvfleet sim-vllm` workers with a clock.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from support.waits import wait_until

from controller.metrics import Metrics
from controller.router import Router, RouterConfig, WorkerSpec
from fleet.app.testkit.sim_vllm.config import SimEngineConfig
from fleet.app.testkit.sim_vllm.main import SimConfig, SimVllm
from fleet.cas import open_store
from fleet.core.errors import FailedPrecondition

HISTORY = list(range(1000, 1100))  # 6 full blocks


async def _busy(url: str) -> int:
    body = {"prompt": HISTORY, "max_tokens": 100}  # decodes for about 4 s: in flight until the checks below, on a loaded machine too
    async with aiohttp.ClientSession() as h, h.post(url + "/v1/completions", json=body) as resp:
        await resp.read()
        return resp.status


@pytest.mark.parametrize("how", ["unregister", "stop"])
async def test_a_draining_reset_whose_worker_stops_answers_failed_precondition(tmp_path, how: str) -> None:
    store = open_store(f"sqlite:///{tmp_path}/kv.db")
    eng = SimEngineConfig(model="m", num_blocks=64, time_scale=1.0, decode_base_s=0.04)
    sims = [await SimVllm(SimConfig(engine=eng)).start() for _ in range(2)]
    r = Router(store, Metrics(), RouterConfig(reconcile_interval_s=0.1, reset_drain_s=10.0))
    await r.start()
    stopped = False
    try:
        for i, sim in enumerate(sims):
            await r.register_worker(WorkerSpec(f"w{i}", sim.url, sim.kv_events, sim.replay, "m"))
        busy = asyncio.create_task(_busy(sims[0].url))
        for _ in range(200):
            if sims[0].engine.running:
                break
            await asyncio.sleep(0.01)
        w0 = r.worker("w0")
        verb = asyncio.create_task(r.lifecycle("w0", "reset_prefix_cache"))
        await wait_until(lambda: w0.transitioning, "the reset to begin")
        await asyncio.sleep(0.3)
        assert not verb.done() and w0.transitioning  # draining: refused, asked again
        if how == "unregister":
            await r.unregister_worker("w0")
        else:
            await r.stop()
            stopped = True
        with pytest.raises(FailedPrecondition, match="unregistered \\(or the controller stopped\\)"):
            await asyncio.wait_for(verb, 2.0)  # before (stop): RuntimeError: Session is closed
        assert not w0.transitioning and not w0.draining and not w0.lock.locked()
        assert sims[0].engine.running  # the request in flight goes on, and the reset was never done
        assert await busy == 200
        assert len(sims[0].engine.resident_external()) == len(HISTORY) // 16  # its cache whole: nothing reset it
    finally:
        if not stopped:
            await r.stop()
        for sim in sims:
            await sim.stop()
