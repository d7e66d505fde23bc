"""A leader whose lease has run out writes nothing to the store (controller/leader.py FencedStore).

The real Router on a real SQLite store and a `kvfleet sim-vllm` stand-in; the lease is a flag the test flips, as a
leader paused past its lease (a GC pause, a frozen VM) finds it when it wakes. NOTE: woken, its verb that had timed
out meanwhile wrote the worker's rank state over the new leader's (an older epoch, no fence), and the next leader
read it back and routed WARM to a cache the new leader had seen reset (review finding, on a real Redis with two
controllers). The control is the same verb with the lease held: it is written.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from controller.leader import FencedStore
from controller.metrics import Metrics
from controller.router import Router, RouterConfig, WorkerSpec
from fleet.app.testkit.sim_vllm.config import SimEngineConfig
from fleet.app.testkit.sim_vllm.main import SimConfig, SimVllm
from fleet.cas import open_store
from fleet.core.errors import Unavailable


async def test_a_leader_past_its_lease_leaves_the_new_leaders_records_as_they_are(tmp_path: Path) -> None:
    store = open_store(f"sqlite:///{tmp_path}/kv.db")
    lease = [True]
    sim = await SimVllm(SimConfig(engine=SimEngineConfig(model="m", num_blocks=64))).start()
    r = Router(FencedStore(store, lambda: lease[0]), Metrics(), RouterConfig(reconcile_interval_s=30.0))
    await r.start()
    try:
        await r.register_worker(WorkerSpec("w0", sim.url, sim.kv_events, sim.replay, "m"))
        await r.lifecycle("w0", "sleep", level=1)                   # control: within the lease, written
        written = json.loads(store.kv_get("epochs", "w0/0"))
        assert written["phase"] == "sleeping"
        newer = {**written, "epoch": written["epoch"] + 5, "fence": "clear"}   # what the new leader wrote
        store.kv_put("epochs", "w0/0", json.dumps(newer).encode())
        lease[0] = False                                          # this one's lease ran out (it was paused)
        await r.lifecycle("w0", "wake_up")                        # its state moves in memory ...
        assert r.worker("w0").ranks[0].phase == "serving"
        assert json.loads(store.kv_get("epochs", "w0/0")) == newer  # ... and nothing of it reaches the store
        assert r.metrics.worker_errors.labels("persist")._value.get() >= 1
        try:
            await r.register_worker(WorkerSpec("w1", sim.url, sim.kv_events, sim.replay, "m"))
        except Unavailable as e:
            assert "leader lease has run out" in str(e)
        else:
            raise AssertionError("a registration past the lease was written")
        assert store.kv_get("workers", "w1") is None
    finally:
        await r.stop()
        await sim.stop()
        store.close()


async def test_a_leading_controller_routes_through_the_fence(tmp_path: Path, redis_url: str) -> None:
    """The wiring: a controller with leader election gives its router the fenced store, tied to its lock's lease;
    one without keeps the plain store."""
    from support.controller import make_tokens, start_controller

    tok = make_tokens(tmp_path)
    ctl = await start_controller(redis_url, tok, leader_election=True, leader_ttl_s=2.0, start_router=True,
                                 gc_interval_s=0)
    try:
        for _ in range(200):
            if ctl.ctx.router is not None:
                break
            await asyncio.sleep(0.02)
        fenced = ctl.ctx.router.store
        assert isinstance(fenced, FencedStore) and fenced._leading()
        ctl._lock.valid_until = 0.0                               # type: ignore[union-attr]  # the lease ran out
        assert not fenced._leading()
    finally:
        await ctl.stop(0)
