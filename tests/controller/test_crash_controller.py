"""Crashes, not graceful stops: SIGKILL of the `kvfleet controller` process mid-traffic and of its
Redis (issue #13, crash tests).

A killed controller persists nothing on the way out (no `router.stop()`): what survives is what it
wrote while running. The workers are real vLLM stand-ins (HTTP + ZMQ PUB + replay) in this
process; the oracle is each stand-in's true cache (/sim/cache). Asserted after every crash:
0 stale warm routes (a WARM answer for a worker that is not serving or lacks the matched
prefix), warmth rebuilt by replay from the persisted seqs, the registry intact, and the
swallowed-error list empty.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from fleet.app.redis_server import RedisServer
from fleet.app.testkit.sim_vllm.config import SimEngineConfig
from fleet.app.testkit.sim_vllm.main import SimConfig, SimVllm
from fleet.core.block_hash import HashConfig, external_chain
from fleet.core.errors import Unavailable
from fleet.sdk import NO_RETRY, AsyncFleetClient

ROOT = Path(__file__).resolve().parents[2]
B = 16


class Fleet:
    """A controller process on a store, two stand-ins, and the oracle's tally."""

    def __init__(self, store: str, sims: list[SimVllm], http: aiohttp.ClientSession) -> None:
        self.store, self.sims, self.http = store, sims, http
        self.proc: subprocess.Popen[str] | None = None
        self.address = ""
        self.rng = random.Random(5)
        self.convs = [[self.rng.randrange(100, 150000) for _ in range(48)] for _ in range(6)]
        self.warm = self.stale = self.routes = self.down = 0
        self.warm_by: dict[str, int] = {}
        self.errors: list[str] = []

    async def start_controller(self) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fleet.app.cli.main", "controller", "--listen", "127.0.0.1:0", "--store", self.store,
             "--metrics-port", "-1"], cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT)
        line = await asyncio.to_thread(self._wait_line, "kvfleet controller listening on")
        self.address = line.split("listening on ")[1].split(" ")[0]

    def _wait_line(self, needle: str) -> str:
        assert self.proc is not None and self.proc.stdout is not None
        seen = []
        for line in self.proc.stdout:
            seen.append(line)
            if needle in line:
                return line
        raise AssertionError(f"no {needle!r} in the controller's output: {''.join(seen)}")

    def sigkill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def client(self) -> AsyncFleetClient:
        return AsyncFleetClient(self.address, retry=NO_RETRY, timeout=10)

    async def truth(self, url: str) -> dict[str, Any]:
        async with self.http.get(url + "/sim/cache") as r:
            return dict(await r.json())

    async def turn(self, c: AsyncFleetClient, k: int) -> None:
        """One conversation turn: route, check the verdict against the true cache, send, grow."""
        toks = self.convs[k] + [self.rng.randrange(100, 150000) for _ in range(20)]
        try:
            d = await c.route(toks, "m")
        except Unavailable:
            self.down += 1
            return
        self.routes += 1
        truth = await self.truth(d.url)
        if d.warm:
            self.warm += 1
            self.warm_by[d.worker] = self.warm_by.get(d.worker, 0) + 1
            have = set(truth["block_hashes"])
            chain = external_chain(HashConfig("sha256", None, B), toks, cache_salt=d.cache_salt)
            if not truth["serving"] or not set(chain[: d.matched_tokens // B]) <= have:
                self.stale += 1
        if not truth["serving"]:
            return  # a request to a sleeping vLLM hangs: a client would not send it
        try:
            async with self.http.post(d.url + "/v1/completions",
                                      json={"prompt": toks, "max_tokens": 4, "cache_salt": d.cache_salt}) as r:
                await r.read()
                if r.status != 200:
                    self.errors.append(f"completion on {d.worker}: HTTP {r.status}")
                    return
        except TimeoutError:
            self.errors.append(f"completion on {d.worker} got no answer")
            return
        self.convs[k] = toks + [100 + k] * 4
        await asyncio.sleep(0.05)  # the controller ingests the batch before this conversation's next turn

    async def traffic(self, n: int) -> None:
        async with self.client() as c:
            for i in range(n):
                await self.turn(c, i % len(self.convs))


@pytest.fixture
async def fleet(redis_url: str) -> AsyncIterator[Fleet]:
    sims = [await SimVllm(SimConfig(engine=SimEngineConfig(model="m", block_size=B, num_blocks=512))).start()
            for _ in range(2)]
    http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20))
    f = Fleet(redis_url, sims, http)
    try:
        yield f
    finally:
        if f.proc is not None and f.proc.poll() is None:
            f.sigkill()
        await http.close()
        for s in sims:
            await s.stop()


@pytest.mark.slow
async def test_controller_sigkill_mid_traffic_and_redis_sigkill(fleet: Fleet, redis_server: RedisServer) -> None:
    f = fleet
    await f.start_controller()
    async with f.client() as c:
        for i, s in enumerate(f.sims):
            await c.register_worker(f"w{i}", url=s.url, kv_events=s.kv_events, replay=s.replay or "", model="m")
    await asyncio.sleep(0.3)  # SUB sockets join
    await f.traffic(24)
    assert f.warm > 5 and f.stale == 0, (f.warm, f.stale)  # non-vacuous: warm verdicts were checked

    # 1. SIGKILL the controller in the middle of traffic; while it is dead, w0 is slept behind its back
    busy = asyncio.create_task(f.traffic(40))
    await asyncio.sleep(0.6)
    f.sigkill()
    await busy  # the rest of the turns met a dead controller (UNAVAILABLE), none hung
    async with f.http.post(f.sims[0].url + "/sleep", params={"level": "1"}) as r:
        assert r.status == 200
    before = (f.warm, f.stale, dict(f.warm_by))
    await f.start_controller()
    async with f.client() as c:
        listed = {w.name for w in await c.workers()}
    assert listed == {"w0", "w1"}  # the registry survived the crash
    await asyncio.sleep(0.5)
    await f.traffic(24)
    print("after controller SIGKILL: warm", f.warm - before[0], "stale", f.stale, "by worker", f.warm_by,
          "unavailable turns", f.down)
    assert f.stale == 0
    assert f.warm_by.get("w1", 0) > before[2].get("w1", 0)  # w1's warmth rebuilt by replay, not re-announced
    assert f.warm_by.get("w0", 0) == before[2].get("w0", 0)  # the slept w0 is never WARM again

    # 2. SIGKILL Redis: the controller keeps routing (and listing) from memory, then resumes writing
    async with f.http.post(f.sims[0].url + "/wake_up") as r:
        assert r.status == 200
    redis_server.kill()
    try:
        busy = asyncio.create_task(f.traffic(12))
        async with f.client() as c:
            assert {w.name for w in await c.workers()} == {"w0", "w1"}  # no INTERNAL, no crash
        await busy
    finally:
        redis_server.start()
    assert f.proc is not None and f.proc.poll() is None, "the controller died with its store"
    for _ in range(100):  # the reconcile loops outlived the outage: w0, woken meanwhile, serves again
        async with f.client() as c:
            if all(w.serving for w in await c.workers()):
                break
        await asyncio.sleep(0.1)
    async with f.client() as c:
        assert all(w.serving for w in await c.workers())
    routed = f.routes
    await f.traffic(12)
    assert f.routes == routed + 12
    # 3. and one more crash on top: what was written across the Redis restart is what the next one reads
    f.sigkill()
    await f.start_controller()
    await asyncio.sleep(0.5)
    await f.traffic(24)
    async with f.client() as c:
        assert {w.name for w in await c.workers()} == {"w0", "w1"}
    print("totals: routes", f.routes, "warm", f.warm, "stale", f.stale, "by worker", f.warm_by, "errors", f.errors)
    assert f.stale == 0
    assert f.errors == []
