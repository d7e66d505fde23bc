"""The fleet routing bench's reset target (`--reset-target`, bench/peers/workers.py `SimFleet.busiest`).

"cached" (the default) resets the awake worker holding the most cached blocks. "received" resets the awake worker
that received the most requests since the start, and requests that reached a worker while it slept count: the
target then depends on where each router sent its requests (in tenants2 a router that sent requests to the slept
worker had its reset land on that worker once woken, its cache already emptied by the sleep; docs/routing.md).
Real stand-ins on loopback; the two targets must differ here, or the option would change nothing."""

from __future__ import annotations

import sys
from pathlib import Path

import aiohttp
import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

from peers.workers import SimFleet  # noqa: E402

from fleet.app.testkit.sim_vllm.config import SimEngineConfig  # noqa: E402

pytestmark = pytest.mark.timeout(60)


async def _complete(http: aiohttp.ClientSession, url: str, words: int, tag: str) -> None:
    body = {"model": "sim-model", "prompt": " ".join(f"{tag}{i}" for i in range(words)), "max_tokens": 1}
    async with http.post(url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=10)) as r:
        assert r.status == 200, await r.text()


async def test_received_and_cached_pick_different_workers_and_never_a_sleeping_one() -> None:
    fleet = await SimFleet.start(3, SimEngineConfig(num_blocks=512))
    try:
        async with aiohttp.ClientSession() as http:
            for i in range(6):  # w0: many short prompts
                await _complete(http, fleet.sims["w0"].url, 8, f"s{i}x")
            await _complete(http, fleet.sims["w1"].url, 600, "long")  # w1: one long prompt, the most blocks
            await _complete(http, fleet.sims["w2"].url, 40, "mid")
            cached = {n: len(s.engine.cache) for n, s in fleet.sims.items()}
            print("cached blocks", cached)
            assert cached["w1"] > max(cached["w0"], cached["w2"])
            assert fleet.busiest("received") == "w0"
            assert fleet.busiest("cached") == "w1"
            async with http.post(fleet.sims["w1"].url + "/sleep?level=1", timeout=aiohttp.ClientTimeout(total=10)):
                pass
            assert fleet.asleep("w1")
            assert fleet.busiest("cached") != "w1"  # an asleep worker is never the target
            with pytest.raises(ValueError, match="one of received, cached"):
                fleet.busiest("most")  # a misspelt target is refused, not taken for the default
    finally:
        await fleet.stop()

