"""The real Router on a fresh SQLite store with one `kvfleet sim-vllm` stand-in registered as w0
(tests/support/stand_ins.py), its pool size known (its /metrics read) before the test starts."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp

from controller.cost import CostConfig
from controller.router import Router
from fleet.app.testkit.sim_vllm.config import SimEngineConfig
from fleet.app.testkit.sim_vllm.main import SimVllm
from support.stand_ins import capacities_known, routed_stand_ins


@contextlib.asynccontextmanager
async def one_worker(tmp_path: Path, num_blocks: int, cost: CostConfig | None = None,
                     engine: SimEngineConfig | None = None) -> AsyncIterator[tuple[Router, SimVllm]]:
    """`engine`: the stand-in's config where the default (model m, `num_blocks`, instant answers) will not do."""
    # NOTE: http_timeout_s 10 (default 2): the stand-in shares this test's event loop, and on a loaded machine a look
    # that waited 2 s marked it down, dropping its index (fail closed, as it should), so a "before" route went COLD
    async with routed_stand_ins(tmp_path, engine or SimEngineConfig(model="m", num_blocks=num_blocks), n=1,
                                http_timeout_s=10.0, cost=cost or CostConfig()) as (r, (sim,)):
        await capacities_known(r)
        yield r, sim


async def complete_direct(sim: SimVllm, r: Router, toks: list[int]) -> None:
    """One request straight to the worker (behind the router's back), then wait until the router has every batch
    the worker published."""
    async with aiohttp.ClientSession() as h, h.post(sim.url + "/v1/completions", json={"prompt": toks}) as resp:
        assert resp.status == 200
    await synced(r, sim)


async def synced(r: Router, sim: SimVllm) -> None:
    """Wait until the worker is registered and the router has ingested every batch it published."""
    assert sim.publisher is not None
    for _ in range(300):
        await asyncio.sleep(0.01)
        mine = [s for s in r.workers() if s.url == sim.url]
        if mine and all(s.last_seq >= sim.publisher.seq - 1 for s in mine):
            return
    raise AssertionError("the router never ingested the worker's events")


async def warm(r: Router, toks: list[int], model: str = "m") -> None:
    """Wait until an (untracked) route of `toks` is WARM: the blocks ingested AND the rank's warmth proven for its
    epoch (a busy machine can see the events before the proof; a test's "before" must not start earlier)."""
    for _ in range(300):
        if (await r.route(toks, model)).verdict == "WARM":
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the router never routed the prompt WARM")
