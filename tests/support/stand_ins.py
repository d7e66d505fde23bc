"""The real Router on a fresh SQLite store with `n` `kvfleet sim-vllm` stand-ins registered as w0, w1, ..., and a
plain completion sent straight to one of them (behind the router's back, as vLLM's own clients would)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp

from controller.metrics import Metrics
from controller.router import Router, RouterConfig, WorkerSpec
from fleet.app.testkit.sim_vllm.config import SimEngineConfig
from fleet.app.testkit.sim_vllm.main import SimConfig, SimVllm
from fleet.cas import open_store


@contextlib.asynccontextmanager
async def routed_stand_ins(tmp_path: Path, engine: SimEngineConfig, n: int = 2,
                           **router_kw: Any) -> AsyncIterator[tuple[Router, list[SimVllm]]]:
    """`router_kw`: RouterConfig fields beside reconcile_interval_s=0.1."""
    store = open_store(f"sqlite:///{tmp_path}/kv.db")
    sims = [await SimVllm(SimConfig(engine=engine)).start() for _ in range(n)]
    r = Router(store, Metrics(), RouterConfig(**{"reconcile_interval_s": 0.1, **router_kw}))
    await r.start()
    try:
        for i, sim in enumerate(sims):
            await r.register_worker(WorkerSpec(f"w{i}", sim.url, sim.kv_events, sim.replay, engine.model))
        yield r, sims
    finally:
        await r.stop()
        for sim in sims:
            await sim.stop()
        store.close()


async def capacities_known(r: Router, timeout_s: float = 10.0) -> None:
    """Wait until the router has looked at every registered worker's pool size (vllm:cache_config_info): what a
    route's cost needs. NOTE: a fixed wait for it fell short on a loaded machine."""
    for _ in range(int(timeout_s / 0.02)):
        if all(r.worker(s.name).view().load.num_gpu_blocks for s in r.workers()):
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the workers' capacities were never looked at")


async def complete(url: str, prompt: list[int], max_tokens: int) -> tuple[int, Any]:
    """POST /v1/completions with token ids: (status, the parsed body, or None when it is not JSON)."""
    async with aiohttp.ClientSession() as h, h.post(url + "/v1/completions",
                                                    json={"prompt": prompt, "max_tokens": max_tokens}) as resp:
        try:
            return resp.status, await resp.json(content_type=None)
        except ValueError:
            return resp.status, None


def runs_a_request(sim: SimVllm) -> bool:
    """Whether the stand-in runs a request (in its batch, holding blocks): what a pause or sleep with mode=wait lets
    finish. NOTE: one still queued (waiting) is not drained: it waits for the resume or wake, as in vLLM."""
    return bool(sim.engine.sched.running)


@contextlib.asynccontextmanager
async def wait_sleep_under_a_request(http: aiohttp.ClientSession, sim: SimVllm,
                                     prompt: list[int]) -> AsyncIterator[asyncio.Task[aiohttp.ClientResponse]]:
    """A `/sleep?level=1&mode=wait` sent behind any router's back while a long request (200 tokens) runs on `sim`:
    yields the sleep's task, still draining; on leaving, the request's client goes away (the request is aborted, so
    the drain ends) and the sleep must answer 200 within 10 s."""

    async def request() -> None:
        async with http.post(sim.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 200}) as resp:
            await resp.read()

    req = asyncio.create_task(request())
    for _ in range(500):
        if runs_a_request(sim):
            break
        await asyncio.sleep(0.01)
    verb = asyncio.create_task(http.post(sim.url + "/sleep", params={"level": "1", "mode": "wait"}))
    try:
        yield verb
    finally:
        req.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await req
        async with await asyncio.wait_for(verb, 10.0) as resp:
            assert resp.status == 200
