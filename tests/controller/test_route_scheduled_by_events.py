"""With `scheduled_by_events` on (opt-in), a tracked route leaves its worker's queue when the worker's KV events store
its prompt's last full block (InFlight.scheduled; issue #27).

vLLM stores a prompt's full blocks in the step that schedules it, so from that event on the route's prefill no longer
waits. Off (the default), a route counts as queued until a /metrics look at least the reconcile grace after it, or its
release: a request long scheduled (decoding, or done and not yet released) still charges its whole prefill to its
worker's queue. On the routing bench that inflated queue placed better (docs/routing.md, "Queued until seen
scheduled"), so the truer one is opt-in. The real Router on a `kvfleet sim-vllm` worker; the request really runs
there. The reconcile grace is set past the test's length, so no /metrics look can take the route out: the control
(off) shows it stays queued.
"""

from __future__ import annotations

import asyncio

import aiohttp
from support.stand_ins import capacities_known

from controller.cost import CostConfig
from controller.inflight import Flight, InFlight
from controller.metrics import Metrics
from controller.router import Router, RouterConfig, WorkerSpec
from fleet.app.testkit.sim_vllm.config import SimEngineConfig
from fleet.app.testkit.sim_vllm.main import SimConfig, SimVllm
from fleet.cas import open_store

PROMPT = list(range(1, 353))  # 22 full blocks of 16 tokens


async def _load_after_it_ran(path: str, on: bool) -> tuple[int, int, int]:
    """(active, queued, queued tokens) of the worker once the routed request ran there and its events arrived."""
    store = open_store(f"sqlite:///{path}")
    sim = await SimVllm(SimConfig(engine=SimEngineConfig(model="m", num_blocks=256))).start()
    r = Router(store, Metrics(), RouterConfig(
        reconcile_interval_s=0.1, cost=CostConfig(reconcile_grace_s=30.0, scheduled_by_events=on)))
    await r.start()
    try:
        await r.register_worker(WorkerSpec("w0", sim.url, sim.kv_events, sim.replay, "m"))
        await capacities_known(r)
        d = await r.route(PROMPT, "m", track=True)
        key = (d.worker, 0)
        assert d.verdict == "COLD" and r.flights.load(key) == (1, 1, 352)  # queued until it is seen scheduled
        async with aiohttp.ClientSession() as h, h.post(
            sim.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}
        ) as resp:
            assert resp.status == 200, await resp.text()
        for _ in range(300):  # until the worker's BlockStored events have reached the index
            if (await r.route(PROMPT, "m")).matched_tokens == 352:
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("the worker's KV events never proved the prompt")
        return r.flights.load(key)  # the route is never released here: it stays active
    finally:
        await r.stop()
        await sim.stop()


async def test_a_route_its_worker_stored_no_longer_counts_as_queued(tmp_path) -> None:
    assert await _load_after_it_ran(f"{tmp_path}/kv.db", on=True) == (1, 0, 0)


async def test_control_off_it_stays_queued_until_a_look(tmp_path) -> None:
    assert await _load_after_it_ran(f"{tmp_path}/kv.db", on=False) == (1, 1, 352)


def test_only_the_routes_whose_last_block_was_stored_on_their_own_rank_leave_the_queue() -> None:
    f = InFlight(ttl_s=60, grace_s=0.25, default_tokens=256)
    a, b = ("w0", 0), ("w1", 0)
    f.add(Flight("a" * 32, a, 352, 5, None, 0.0))
    f.add(Flight("b" * 32, b, 352, 5, None, 0.0))  # the same prompt on another worker
    f.add(Flight("c" * 32, a, 100, 9, None, 0.0))
    assert f.scheduled(a, [1, 2, 3]) == 0  # another prompt's blocks (its first blocks are not its last)
    assert f.scheduled(a, [4, 5]) == 1
    assert f.load(a) == (2, 1, 100) and f.load(b) == (1, 1, 352)
    assert f.mean_tokens(a) == 352.0  # seen scheduled: its prefill joins the rank's mean
    assert f.scheduled(a, [5]) == 0  # once
    assert f.extended([5]) == {b: 352}  # no longer queued on a, so nothing of it is taken off a's queue
    f.release("a" * 32)
    assert f.load(a) == (1, 1, 100)
