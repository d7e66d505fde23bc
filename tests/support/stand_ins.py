"""The real Router on a fresh SQLite store with `n` `kvfleet sim-vllm` stand-ins registered as w0, w1, ..., and a
plain completion sent straight to one of them (behind the router's back, as vLLM's own clients would)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp

from controller.metrics import Metrics
from controller.router import Router, RouterConfig, WorkerSpec
from fleet.app.testkit.sim_vllm.engine import SimEngineConfig
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


async def complete(url: str, prompt: list[int], max_tokens: int) -> tuple[int, Any]:
    """POST /v1/completions with token ids: (status, the parsed body, or None when it is not JSON)."""
    async with aiohttp.ClientSession() as h, h.post(url + "/v1/completions",
                                                    json={"prompt": prompt, "max_tokens": max_tokens}) as resp:
        try:
            return resp.status, await resp.json(content_type=None)
        except ValueError:
            return resp.status, None
