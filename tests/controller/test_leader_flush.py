"""A flushed Redis under controllers with leader election: the flush takes the leader lock with the worker registry,
and the controller that leads next must come to watch the workers the old leader writes back (controller/server.py
Controller._store_lost, _reload_registry, step_down; controller/router_workers.py load_registry).

NOTE: before, a router read the registry once, at its start: a standby that took the lead while the store was empty
listed no worker for good and refused every route, though the registrations were written back; and a leader whose
renew found the lock gone stepped down before its probe found the loss, so it wrote nothing back.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
import redis
from support.controller import make_tokens, start_controller

from controller.server import Controller
from fleet.app.testkit.sim_vllm.config import SimEngineConfig
from fleet.app.testkit.sim_vllm.main import SimConfig, SimVllm
from fleet.sdk import AsyncFleetClient

TTL_S = 3.0  # a standby asks for the lock every ttl/5 (0.6 s), the leader renews every ttl/3 (1 s)


async def _listed(ctl: Controller, token: str) -> list[str]:
    async with AsyncFleetClient(ctl.address, token=token) as c:
        return sorted({w.name for w in await c.workers()})


async def _until(pred: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not await pred():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


async def _sim() -> SimVllm:
    return await SimVllm(SimConfig(engine=SimEngineConfig(model="m", block_size=16, num_blocks=64))).start()


async def test_a_leader_watches_the_workers_written_back_before_its_probe_found_the_loss(
        redis_url: str, tmp_path: Path) -> None:
    """The store comes back holding only a registration another controller wrote back (one transaction: the flush and
    the write), before this leader's probe finds the loss; the leader then watches that worker too."""
    tokens, sim = make_tokens(tmp_path), await _sim()
    ctl = await start_controller(redis_url, tokens, start_router=True, store_ping_interval_s=0.1, gc_interval_s=0)
    r = redis.Redis.from_url(redis_url)
    try:
        await asyncio.sleep(0.3)  # the probe has read the marker
        assert await _listed(ctl, tokens.op) == []
        spec = {"name": "w0", "url": sim.url, "kv_events": sim.kv_events, "replay": sim.replay, "model": "m"}
        with r.pipeline(transaction=True) as p:
            p.flushall()
            p.hset("kvf:kv:workers", "w0", json.dumps(spec))
            p.execute()

        async def listed() -> bool:
            return await _listed(ctl, tokens.op) == ["w0"]

        await _until(listed, 5.0, "the leader never watched the registration the store holds")  # before: []
    finally:
        r.close()
        await ctl.stop(0)
        await sim.stop()


@pytest.mark.slow
async def test_the_controller_that_leads_after_a_flush_watches_the_old_leaders_workers(
        redis_url: str, tmp_path: Path) -> None:
    """A leads with w0 registered, B stands by; a flush right after A's renew: B takes the free lock before A's next
    renew, with an empty registry; A's renew fails and A steps down. A's scheduled probe is far off: its write-back
    comes from the probe at its step-down, and B reads it one lease after taking the lead. (On a loaded machine A may
    renew first, find the lock gone, step down and take it again: it must list w0 then too.)"""
    tokens, sim = make_tokens(tmp_path), await _sim()
    a = await start_controller(redis_url, tokens, start_router=True, leader_election=True, leader_ttl_s=TTL_S,
                               store_ping_interval_s=60, gc_interval_s=0)
    b: Controller | None = None
    r = redis.Redis.from_url(redis_url)
    step_down, stepped_down = a.step_down, []

    async def counted() -> None:
        stepped_down.append(time.monotonic())
        await step_down()

    a.step_down = counted  # type: ignore[method-assign]
    try:
        async def a_leads() -> bool:
            return a.ctx.leader

        await _until(a_leads, 10.0, "A never led")
        b = await start_controller(redis_url, tokens, start_router=True, leader_election=True, leader_ttl_s=TTL_S,
                                   store_ping_interval_s=0.1, gc_interval_s=0)
        async with AsyncFleetClient(a.address, token=tokens.op) as c:
            await c.register_worker("w0", url=sim.url, kv_events=sim.kv_events, replay=sim.replay or "", model="m")
        await asyncio.sleep(0.3)  # B's probe has read the marker A's first probe wrote
        assert a._lock is not None
        renewed, deadline = a._lock.valid_until, time.monotonic() + 2 * TTL_S
        while a._lock.valid_until == renewed:  # flush just after a renew: B's ask (<= 0.6 s) comes before A's (1 s)
            assert a.ctx.leader and not stepped_down and time.monotonic() < deadline, "A stopped leading"
            await asyncio.sleep(0.01)
        r.flushall()
        both = (a, b)

        async def a_stepped_down() -> bool:
            return bool(stepped_down)

        await _until(a_stepped_down, 3 * TTL_S, "A never stepped down")

        async def the_leader_lists_w0() -> bool:
            leaders = [ctl for ctl in both if ctl.ctx.leader]
            return len(leaders) == 1 and await _listed(leaders[0], tokens.op) == ["w0"]

        await _until(the_leader_lists_w0, 3 * TTL_S, "the leader never watched w0")  # before: [] for good (B led)
        assert r.hkeys("kvf:kv:workers") == [b"w0"]  # before: gone
    finally:
        r.close()
        if b is not None:
            await b.stop(0)
        await a.stop(0)
        await sim.stop()
