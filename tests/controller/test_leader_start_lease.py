"""The leader's lease is renewed while it starts its router (controller.server: _lead).

A controller leads only once its router has started, and a router's start waits for every registered worker's
catch-up (its replay, its first look). Before, nothing renewed the leader lock meanwhile: a start longer than the
lease (a worker whose replay or HTTP does not answer, up to their deadlines: seconds) let the lock expire, and the
controller, done starting, found it lost, stepped down and started again. Real Redis, a real controller with leader
election, a real stand-in whose registered replay endpoint holds every request until the test lets it go.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import redis
import zmq.asyncio
from support.held_replay import HELD, HeldReplay

from controller.config import ControllerConfig
from controller.leader import KEY
from controller.metrics import Metrics
from controller.router import Router, RouterConfig, WorkerSpec
from controller.server import build_server
from fleet.app.testkit.sim_vllm.config import SimEngineConfig
from fleet.app.testkit.sim_vllm.main import SimConfig, SimVllm
from fleet.cas import open_store

TTL_S = 1.0


async def _until(pred, what: str, timeout_s: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.02)


async def test_the_lock_stays_held_while_the_new_leaders_router_waits_for_a_workers_replay(
    tmp_path: Path, redis_url: str
) -> None:
    sim = await SimVllm(SimConfig(engine=SimEngineConfig(model="m", num_blocks=64))).start()
    ctx = zmq.asyncio.Context()
    held = HeldReplay(ctx, 1)
    store = open_store(redis_url)
    r = redis.Redis.from_url(redis_url)
    ctl = None
    try:
        Router(store, Metrics(), RouterConfig()).registry.put(  # registered as register_worker writes it
            WorkerSpec("w", sim.url, sim.kv_events, held.endpoint, "m"))
        cfg = ControllerConfig(store_url=redis_url, tokens_file=None, listen="127.0.0.1:0", leader_election=True,
                               leader_ttl_s=TTL_S, gc_interval_s=0)
        ctl = await build_server(cfg, metrics=Metrics(), router_config=RouterConfig(stream=HELD))
        await _until(lambda: held.requests == 1, "the new leader's router never asked the worker's replay")
        owner = r.get(KEY)
        assert owner is not None  # it took the lock, and its router's start now waits on the replay
        t0 = time.monotonic()
        while time.monotonic() - t0 < 3 * TTL_S:  # three leases with the start held
            # before the fix: the key expired a lease after it was taken (nothing renewed it during the start)
            assert r.get(KEY) == owner, "the leader lock lapsed while the router started"
            assert not ctl.ctx.leader  # control: still starting (the replay is held)
            await asyncio.sleep(0.05)
        held.released.set()
        await _until(lambda: ctl.ctx.leader, "the controller never led once the replay answered")
        assert r.get(KEY) == owner  # the same lock it took: it did not lose it and take it again
    finally:
        held.released.set()
        if ctl is not None:
            await ctl.stop(0)
        await held.close()
        ctx.term()
        store.close()
        await sim.stop()
