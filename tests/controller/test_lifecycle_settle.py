"""A verb through the controller lets the routes decided just before it reach the worker first (issue #27).

The proxy forwards a request after the controller answered its route. A sleep asked in between used to overtake
it: the worker was asleep when the request arrived, which queued there until the wake (one request in the
fleet-routing-real bench's short-chats cell, through the controller). Now the verb, once the worker is out of
routing, waits until the newest tracked route to it is --route-reconcile-grace old (the time the ledger already
allows a route to reach its worker), then calls vLLM. The real Router on two `kvfleet sim-vllm` workers with a
clock; the control sets the grace to 0, which is the earlier behaviour.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
import pytest

from controller.cost import CostConfig
from controller.metrics import Metrics
from controller.router import Router, RouterConfig, WorkerSpec
from fleet.app.testkit.sim_vllm.config import SimEngineConfig
from fleet.app.testkit.sim_vllm.main import SimConfig, SimVllm
from fleet.cas import open_store

PROMPT = list(range(1000, 1100))
FORWARD_S = 0.05  # the proxy's forward, a little late (a busy event loop)


async def _complete(url: str) -> int:
    body = {"prompt": PROMPT, "max_tokens": 4, "stream": True}
    async with aiohttp.ClientSession() as h, h.post(url + "/v1/completions", json=body) as resp:
        async for _ in resp.content:
            pass
        return resp.status


@pytest.mark.parametrize("grace_s", [0.25, 0.0])
async def test_a_sleep_lets_a_route_decided_before_it_reach_the_worker(tmp_path: Path, grace_s: float) -> None:
    store = open_store(f"sqlite:///{tmp_path}/kv.db")
    eng = SimEngineConfig(model="m", num_blocks=64, time_scale=1.0, decode_base_s=0.01)
    sims = [await SimVllm(SimConfig(engine=eng)).start() for _ in range(2)]
    r = Router(store, Metrics(), RouterConfig(reconcile_interval_s=0.1, cost=CostConfig(reconcile_grace_s=grace_s)))
    await r.start()
    try:
        for i, sim in enumerate(sims):
            await r.register_worker(WorkerSpec(f"w{i}", sim.url, sim.kv_events, sim.replay, "m"))
        d = await r.route(PROMPT, "m", track=True)
        sim = sims[int(d.worker[1:])]
        t0 = time.monotonic()
        verb = asyncio.create_task(r.lifecycle(d.worker, "sleep", level=1, mode="wait"))
        await asyncio.sleep(FORWARD_S)
        asleep_at_arrival = sim.engine.is_sleeping()
        if grace_s:
            status = await asyncio.wait_for(_complete(sim.url), 5.0)
            wit = await verb
            took = time.monotonic() - t0
            assert not asleep_at_arrival and status == 200  # it arrived awake and was answered
            assert wit.serving is False and sim.engine.is_sleeping()  # then the worker slept
            assert grace_s - FORWARD_S < took < 2.0
            assert r.metrics.lifecycle_settles._value.get() == 1
            # a route already released is not waited for
            released = await r.route(list(range(7000, 7100)), "m", track=True)
            await r.lifecycle(d.worker, "wake_up")
            assert released.route_id and r.release_route(released.route_id)
            t1 = time.monotonic()
            await r.lifecycle(released.worker, "reset_prefix_cache")
            assert time.monotonic() - t1 < grace_s and r.metrics.lifecycle_settles._value.get() == 1
        else:  # control: the sleep overtook the route, as before
            await verb
            assert asleep_at_arrival
            assert r.metrics.lifecycle_settles._value.get() == 0
    finally:
        await r.stop()
        for s in sims:
            await s.stop()
