"""The fleet routing bench's hazard order (bench/fleet_routing.py `Driver`, `Options.wake_before_reset`).

The sleep ends once the wake point was issued and `sleep_min_s` went by; the reset fires at its own point of the trace.
A router that issues the requests between the sleep and the reset point within `sleep_min_s` (one that keeps its
agents off the slept worker, so none of them waits) used to meet the reset while a worker still slept: a harder
hazard than slower routers met. By default the wake now comes first, at the latest when the reset is due. The control
(`--reset-in-sleep`, the old rule) shows the reset landing inside the sleep on the same schedule, so the test can fail.
Real stand-ins on loopback; the requests' issue count is driven by hand, as a fast router would drive it."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import fleet_routing as fr  # noqa: E402
from peers.launch import CONTENDERS, Running  # noqa: E402
from peers.workers import SimFleet  # noqa: E402
from routing_trace import agents  # noqa: E402

from fleet.app.testkit.sim_vllm.config import SimEngineConfig  # noqa: E402

pytestmark = pytest.mark.timeout(60)


async def _events(wake_before_reset: bool) -> list[dict[str, Any]]:
    wl = agents("order", 0, num_agents=4, num_workers=2, turns=5)  # 20 requests: sleep at 7, wake 10, reset 14
    opt = fr.Options(sleep_min_s=1.0, sleep_max_s=2.0, wake_before_reset=wake_before_reset)
    fleet = await SimFleet.start(2, SimEngineConfig(num_blocks=256))
    try:
        async with aiohttp.ClientSession() as http:
            run = Running(CONTENDERS["sticky"], "", [], [], [], http)  # lifecycle straight to the workers
            d = fr.Driver(wl, run, fleet, opt)
            d._t0 = time.monotonic()
            for _ in range(d.sleep_n):
                d._issue()
            while not any(e["verb"] == "sleep" for e in d.events):  # the sleep has landed
                await asyncio.sleep(0.01)
            for _ in range(d.reset_n - d.sleep_n):  # the wake and reset points at once: well within sleep_min_s
                d._issue()
            await asyncio.sleep(0.05)
            d._done = True  # every session done: a sleep still open ends now
            await asyncio.wait_for(asyncio.gather(*d._tasks), 10)
            return d.events
    finally:
        await fleet.stop()


async def test_a_fast_router_meets_the_wake_before_the_reset() -> None:
    ev = await _events(wake_before_reset=True)
    assert [e["verb"] for e in ev] == ["sleep", "wake_up", "reset_prefix_cache"], ev
    assert all(e["ok"] for e in ev), ev
    wake, reset = ev[1], ev[2]
    assert wake["cut_by_reset"] is True and wake["slept_s"] < 1.0  # cut short by the reset point, not sleep_min_s
    assert wake["at_request"] == reset["at_request"] == 14  # the reset at its own point of the trace


async def test_control_the_old_rule_resets_inside_the_sleep() -> None:
    ev = await _events(wake_before_reset=False)
    assert [e["verb"] for e in ev] == ["sleep", "reset_prefix_cache", "wake_up"], ev
    assert "cut_by_reset" not in ev[2]
