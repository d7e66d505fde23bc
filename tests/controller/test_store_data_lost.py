"""A real redis-server restarted without its data under a running controller: the store probe says so (an error in
the log, kvfleet_store_data_lost_total) and writes back the cache_salt secret the controller holds; a restart that
keeps the data (AOF) is not a loss (controller/store_probe.py)."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import time
from pathlib import Path

import pytest
import redis
from support.controller import make_tokens, start_controller

from controller.kernel_placement import KERNEL_SPEC_KEY, kernel_spec_of
from controller.registry import EpochTable, WorkerRegistry
from controller.server import SALT_SECRET_KEY, Controller
from fleet.app.redis_server import RedisServer
from fleet.app.testkit.sim_vllm.config import SimEngineConfig
from fleet.app.testkit.sim_vllm.main import SimConfig, SimVllm
from fleet.sdk import AsyncFleetClient


def _lost(ctl: Controller) -> float:
    return ctl.ctx.metrics.registry.get_sample_value("kvfleet_store_data_lost_total") or 0.0


async def _probed_again(ctl: Controller, timeout_s: float = 5.0) -> None:
    """Until the probe has answered twice more since now (with the store up)."""
    for _ in range(2):
        deadline = time.monotonic() + timeout_s
        ctl.store_probe.up = None
        while ctl.store_probe.up is not True:
            assert time.monotonic() < deadline, "the store probe never answered"
            await asyncio.sleep(0.05)


def _restart(srv: RedisServer, *, keep_data: bool) -> None:
    srv.kill()
    if not keep_data:  # a Redis with no persistence (or a new empty volume) comes back empty
        for name in os.listdir(srv.dir):
            path = os.path.join(srv.dir, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    srv.start()


@pytest.mark.parametrize("keep_data", [False, True])
async def test_redis_back_without_its_data_is_reported(redis_url: str, redis_server: RedisServer, tmp_path: Path,
                                                       caplog: pytest.LogCaptureFixture, keep_data: bool) -> None:
    ctl = await start_controller(redis_url, make_tokens(tmp_path), store_ping_interval_s=0.1, gc_interval_s=0)
    r = redis.Redis.from_url(redis_url)
    try:
        await _probed_again(ctl)
        ref = await asyncio.to_thread(ctl.ctx.store.put, b"a tool result", "acme")
        caplog.set_level(logging.ERROR, "kvfleet.controller.store")
        _restart(redis_server, keep_data=keep_data)  # on this thread: the server dies with the thread that started it
        await _probed_again(ctl)
        assert await asyncio.to_thread(ctl.ctx.store.exists, ref, "acme") is keep_data
        if keep_data:  # control: the same restart with the data kept is no loss
            assert _lost(ctl) == 0 and "lost its data" not in caplog.text
        else:  # NOTE: before, nothing: the probe's read of a never-written key answered None either way
            assert _lost(ctl) == 1
            assert "the store lost its data" in caplog.text and "every blob" in caplog.text
        assert r.hget(f"kvf:kv:{SALT_SECRET_KEY[0]}", SALT_SECRET_KEY[1]) == ctl.ctx.auth.salt_secret
        await _probed_again(ctl)
        assert _lost(ctl) == (0 if keep_data else 1)  # reported once: the marker is written again
    finally:
        r.close()
        await ctl.stop(0)


async def test_the_leader_writes_back_its_workers_after_the_store_lost_them(
        redis_url: str, redis_server: RedisServer, tmp_path: Path) -> None:
    """A worker registered with the leader, then Redis back empty: the leader writes the registration and the rank
    states back, so the controller started next (a restart) watches the same worker. NOTE: before, the registration
    went with the data: the next controller listed no worker and refused every route."""
    tokens = make_tokens(tmp_path)
    sim = await SimVllm(SimConfig(engine=SimEngineConfig(model="m", block_size=16, num_blocks=64))).start()
    ctl: Controller | None = await start_controller(redis_url, tokens, store_ping_interval_s=0.1, gc_interval_s=0,
                                                    start_router=True)
    later: Controller | None = None
    try:
        assert ctl is not None
        async with AsyncFleetClient(ctl.address, token=tokens.op) as c:
            await c.register_worker("w0", url=sim.url, kv_events=sim.kv_events, replay=sim.replay or "", model="m")
        await _probed_again(ctl)
        registry, epochs = WorkerRegistry(ctl.ctx.store), EpochTable(ctl.ctx.store)
        assert [name for name, _ in registry.entries()] == ["w0"] and epochs.get("w0", 0) is not None
        _restart(redis_server, keep_data=False)
        await _probed_again(ctl)
        assert _lost(ctl) == 1
        assert [name for name, _ in registry.entries()] == ["w0"] and epochs.get("w0", 0) is not None
        await ctl.stop(0)
        ctl = None
        later = await start_controller(redis_url, tokens, gc_interval_s=0, start_router=True)
        async with AsyncFleetClient(later.address, token=tokens.op) as c:
            assert [w.name for w in await c.workers()] == ["w0"]
    finally:
        for c_ in (ctl, later):
            if c_ is not None:
                await c_.stop(0)
        await sim.stop()


async def test_the_leader_learns_of_a_loss_another_controller_found_first(
        redis_url: str, redis_server: RedisServer, tmp_path: Path) -> None:
    """Two controllers on one store; after Redis comes back empty, the other one's probe finds the marker gone first
    and writes it again; the leader's next probe still sees a loss (another marker) and writes its worker back.
    NOTE: before, one marker with no nonce: the leader read it present and never wrote back the registration."""
    tokens = make_tokens(tmp_path)
    sim = await SimVllm(SimConfig(engine=SimEngineConfig(model="m", block_size=16, num_blocks=64))).start()
    leader = await start_controller(redis_url, tokens, store_ping_interval_s=0, gc_interval_s=0, start_router=True)
    other = await start_controller(redis_url, tokens, store_ping_interval_s=0.05, gc_interval_s=0)
    try:
        async with AsyncFleetClient(leader.address, token=tokens.op) as c:
            await c.register_worker("w0", url=sim.url, kv_events=sim.kv_events, replay=sim.replay or "", model="m")
        assert await leader.store_probe.probe()  # the leader has read the marker (its schedule is off: probed here)
        await _probed_again(other)
        _restart(redis_server, keep_data=False)
        deadline = time.monotonic() + 5
        while _lost(other) < 1:  # the other controller found the loss and wrote the marker again
            assert time.monotonic() < deadline, "the other controller's probe never found the loss"
            await asyncio.sleep(0.05)
        registry = WorkerRegistry(leader.ctx.store)
        assert registry.entries() == []  # control: the loss took the registration
        assert await leader.store_probe.probe()
        assert _lost(leader) == 1 and [name for name, _ in registry.entries()] == ["w0"]
    finally:
        await other.stop(0)
        await leader.stop(0)
        await sim.stop()


@pytest.mark.parametrize("flags", [{"backend": "torch", "device": "cpu"}, {}])
async def test_the_kernel_spec_the_controller_holds_is_written_back(redis_url: str, tmp_path: Path,
                                                                   flags: dict[str, str]) -> None:
    """Started with --kernel-* flags, the controller holds the spec they wrote and writes it back after a flush, so the
    first session call builds the fleet with it. NOTE: before, it went with the data and that call wrote the default
    (numpy, the synthetic model) in its place. Control: one with no flag (and no fleet built yet) holds none."""
    ctl = await start_controller(redis_url, make_tokens(tmp_path), store_ping_interval_s=0.1, gc_interval_s=0,
                                 kernel=flags)
    r = redis.Redis.from_url(redis_url)
    try:
        await _probed_again(ctl)
        before = r.hget(f"kvf:kv:{KERNEL_SPEC_KEY[0]}", KERNEL_SPEC_KEY[1])
        assert (before is not None) == bool(flags)
        r.flushall()
        await _probed_again(ctl)
        assert _lost(ctl) == 1
        assert r.hget(f"kvf:kv:{KERNEL_SPEC_KEY[0]}", KERNEL_SPEC_KEY[1]) == before  # before: None
        assert kernel_spec_of(ctl.ctx.store).get("backend") == flags.get("backend")  # before: the default's (none)
    finally:
        r.close()
        await ctl.stop(0)
