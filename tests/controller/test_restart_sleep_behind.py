"""A /sleep and /wake_up behind the controller's back while no controller runs (a rollout, a crash), with no
engine step since the wake: the AllBlocksCleared the sleep queued is not published yet, so nothing in the event
stream shows the wipe. A running controller sees the /sleep count move between two looks; a restarted one had no
count to compare its first look with, and its catch-up replay rebuilt the wiped blocks: WARM routes to an empty
cache. Real Router on SQLite, real `kvfleet sim-vllm` stand-in (HTTP, ZMQ PUB and replay); the oracle is the
stand-in's true cache."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from support.one_worker import complete_direct, synced

from controller.metrics import Metrics
from controller.router import Router, RouterConfig, WorkerSpec
from controller.vllm.subscriber import StreamLimits
from fleet.app.testkit.sim_vllm.config import SimEngineConfig
from fleet.app.testkit.sim_vllm.main import SimConfig, SimVllm
from fleet.cas import open_store
from fleet.cas.base import BlobStore

OLD, BETWEEN, AFTER = list(range(1000, 1100)), list(range(3000, 3100)), list(range(5000, 5100))  # 6 blocks each


def _router(store: BlobStore, replay_timeout_s: float = 10.0) -> Router:
    # NOTE: replay_timeout_s 10 (default 1): the stand-in shares this test's event loop, and on a loaded machine the
    # restarted controller's catch-up replay went unanswered for 1 s: not caught up, the fence a test lifts by the
    # catch-up stayed up (COLD where the test expects WARM)
    return Router(store, Metrics(), RouterConfig(reconcile_interval_s=0.1, http_timeout_s=10.0,
                                                 stream=StreamLimits(replay_timeout_s=replay_timeout_s)))


@contextlib.asynccontextmanager
async def _worker(tmp_path: Path) -> AsyncIterator[tuple[BlobStore, SimVllm]]:
    store = open_store(f"sqlite:///{tmp_path}/kv.db")
    sim = await SimVllm(SimConfig(engine=SimEngineConfig(model="m", num_blocks=64))).start()
    try:
        yield store, sim
    finally:
        await sim.stop()
        store.close()


async def _verdict(r: Router, toks: list[int]) -> tuple[str, int]:
    d = await r.route(toks, "m")
    return d.verdict, d.matched_tokens


async def _serving(r: Router) -> None:
    for _ in range(300):
        if all(s.serving for s in r.workers()):
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the restarted controller never listed the worker serving")


async def _first_life(store: BlobStore, sim: SimVllm) -> None:
    """A controller that saw OLD stored and routed it WARM, then went away."""
    r = _router(store)
    await r.start()
    try:
        await r.register_worker(WorkerSpec("w0", sim.url, sim.kv_events, sim.replay, "m"))
        await complete_direct(sim, r, OLD)
        for _ in range(300):
            if await _verdict(r, OLD) == ("WARM", 96):
                break
            await asyncio.sleep(0.01)
        assert await _verdict(r, OLD) == ("WARM", 96)
        await asyncio.sleep(0.25)  # a look after the request: its /sleep count is the one the store keeps
    finally:
        await r.stop()


@pytest.mark.parametrize("traffic_between", [False, True])
async def test_a_sleep_and_wake_while_no_controller_ran_is_seen_by_the_next_one(tmp_path, traffic_between) -> None:
    async with _worker(tmp_path) as (store, sim), aiohttp.ClientSession() as h:
        await _first_life(store, sim)
        if traffic_between:  # another client's request while no controller runs, then the sleep
            async with h.post(sim.url + "/v1/completions", json={"prompt": BETWEEN}) as resp:
                assert resp.status == 200
        for path in ("/sleep?level=1", "/wake_up"):
            async with h.post(sim.url + path) as resp:
                assert resp.status == 200
        async with h.get(sim.url + "/sim/cache") as resp:
            assert (await resp.json())["block_hashes"] == []  # the truth: the sleep wiped the cache
        r = _router(store)
        await r.start()
        try:
            await _serving(r)
            # before: ("WARM", 96) for both, from the catch-up replay of stores the sleep had wiped
            assert await _verdict(r, OLD) == ("COLD", 0)
            assert await _verdict(r, BETWEEN) == ("COLD", 0)
            # and not COLD for good: the next request publishes the queued clear, then its own blocks
            await complete_direct(sim, r, AFTER)
            assert await _verdict(r, AFTER) == ("WARM", 96)
            assert await _verdict(r, OLD) == ("COLD", 0)
        finally:
            await r.stop()


async def test_control_no_sleep_while_no_controller_ran_stays_warm_by_replay(tmp_path) -> None:
    async with _worker(tmp_path) as (store, sim), aiohttp.ClientSession() as h:
        await _first_life(store, sim)
        async with h.post(sim.url + "/v1/completions", json={"prompt": BETWEEN}) as resp:
            assert resp.status == 200
        epoch = json.loads(store.kv_get("epochs", "w0/0") or b"{}")["epoch"]
        r = _router(store)
        await r.start()
        try:
            await _serving(r)
            await synced(r, sim)
            assert await _verdict(r, OLD) == ("WARM", 96)  # rebuilt by replay, never announced again
            assert await _verdict(r, BETWEEN) == ("WARM", 96)  # stored while no controller ran
            assert r.worker("w0").ranks[0].epoch == epoch  # nothing was invalidated
        finally:
            await r.stop()


async def _fence_left_up(store: BlobStore, sim: SimVllm, h: aiohttp.ClientSession) -> None:
    """The record a controller leaves when a reset it drove ran a step for another client before it read vLLM's
    answer (the batch [AllBlocksCleared, BlockStored...] read first, then the fence "clear" put up past it) and it
    stopped before a later batch lifted the fence (Worker.lift_settled). The clear never comes again."""
    await _first_life(store, sim)
    async with h.post(sim.url + "/reset_prefix_cache") as resp:
        assert resp.status == 200
    async with h.post(sim.url + "/v1/completions", json={"prompt": BETWEEN}) as resp:  # [clear, stores]
        assert resp.status == 200
    assert sim.publisher is not None
    st = json.loads(store.kv_get("epochs", "w0/0") or b"{}")
    last = sim.publisher.seq - 1
    store.kv_put("epochs", "w0/0", json.dumps(st | {"epoch": st["epoch"] + 3, "seq": last, "epoch_seq": last + 1,
                                                    "fence": "clear", "kv": "forgotten"}).encode())


def _replays(r: Router, outcome: str) -> float:
    return float(r.metrics.kv_event_replays.labels(outcome)._value.get())


async def test_a_fence_clear_whose_clear_was_read_before_it_went_up_lifts_after_the_catch_up(tmp_path) -> None:
    """Before, the next controller waited for that clear for good: every prompt routed COLD while the worker held it."""
    async with _worker(tmp_path) as (store, sim), aiohttp.ClientSession() as h:
        await _fence_left_up(store, sim, h)
        r = _router(store)
        await r.start()
        try:
            await _serving(r)
            assert _replays(r, "catch_up") == 1  # control: the catch-up was answered (what lifts the fence here)
            await complete_direct(sim, r, AFTER)  # a batch with no clear: only stores
            assert r.workers()[0].last_seq == sim.publisher.seq - 1  # control: its batch was read
            assert await _verdict(r, AFTER) == ("WARM", 96)  # before: ("COLD", 0), the fence up for good
            assert await _verdict(r, OLD) == ("COLD", 0)  # the reset wiped it
        finally:
            await r.stop()


async def test_a_fence_clear_left_up_lifts_when_the_catch_up_replay_does_not_answer(tmp_path, monkeypatch) -> None:
    """The same record, and the restarted controller's catch-up replay is not answered within its bound (a worker too
    loaded to answer in replay_timeout_s; here 1 us, which no answer meets). Not caught up, the fence stayed up for
    good: every prompt routed COLD while the worker held it. Now the clear may be gone, as after a gap replay could
    not repair: the fence lifts at a batch read CLEAR_SETTLE_S after the start."""
    import controller.vllm.watcher as watcher

    monkeypatch.setattr(watcher, "CLEAR_SETTLE_S", 0.5, raising=False)
    async with _worker(tmp_path) as (store, sim), aiohttp.ClientSession() as h:
        await _fence_left_up(store, sim, h)
        r = _router(store, replay_timeout_s=1e-6)
        await r.start()
        started = time.monotonic()
        try:
            await _serving(r)
            assert (_replays(r, "catch_up"), _replays(r, "failed")) == (0, 1)  # control: the catch-up failed
            await asyncio.sleep(max(0.0, started + 0.5 - time.monotonic()))  # the settle rule's time, not a race
            await complete_direct(sim, r, AFTER)  # a batch with no clear, read CLEAR_SETTLE_S after the start
            assert r.workers()[0].last_seq == sim.publisher.seq - 1  # control: its batch was read
            assert await _verdict(r, AFTER) == ("WARM", 96)  # before: ("COLD", 0), the fence up for good
            assert await _verdict(r, OLD) == ("COLD", 0)
        finally:
            await r.stop()
