"""A /sleep with mode=wait behind the controller's back, still draining under a running request: a look sees what
vLLM 0.33.0 shows then (reference §4: the sleep state recorded only once the sleep has completed, so awake; one
operation in vllm:sleep_mode_operations_in_flight; the scheduler paused, so /is_sleeping true), and the rank stops
serving and drops its index at once (docs/lifecycle.md), not once the sleep has completed. Real Router on SQLite,
real `kvfleet sim-vllm` (real time, a request of 200 decode steps); the drain ends when that request's client leaves.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
from support.one_worker import complete_direct, one_worker, warm
from support.stand_ins import wait_sleep_under_a_request

from fleet.app.testkit.sim_vllm.config import SimEngineConfig
from fleet.core.errors import Unavailable

PROMPT = list(range(1000, 1100))  # 6 blocks


async def test_a_look_during_a_wait_sleeps_drain_sees_awake_with_one_operation_in_flight_and_stops_serving(
        tmp_path: Path) -> None:
    engine = SimEngineConfig(model="m", num_blocks=64, time_scale=1.0, decode_base_s=0.02)
    async with one_worker(tmp_path, 64, engine=engine) as (r, sim), aiohttp.ClientSession() as h:
        await complete_direct(sim, r, PROMPT)
        await warm(r, PROMPT)
        (before,) = r.workers()

        async with wait_sleep_under_a_request(h, sim, list(range(7000, 7040))) as verb:
            for _ in range(500):  # the reconcile looks every 0.1 s
                (st,) = r.workers()
                if not st.serving:
                    break
                await asyncio.sleep(0.01)
            seen = r.worker("w0").view().load
            assert not verb.done(), "the drain ended before the look: the request was too short"
            print(f"look during the drain: sleep_state {seen.sleep_state}, in flight {seen.in_flight}")
            assert seen.awake == 1.0 and seen.in_flight == 1.0  # what vLLM shows while a wait-sleep drains
            assert (st.serving, st.warm) == (False, False) and st.epoch > before.epoch
            with pytest.raises(Unavailable):  # its only worker: no route at all, WARM least of all
                await r.route(PROMPT, "m")
        for _ in range(500):  # control: once done, the look reads it asleep at level 1, the count moved
            (st,) = r.workers()
            if st.phase == "sleeping":
                break
            await asyncio.sleep(0.01)
        assert (st.phase, st.serving, r.worker("w0").view().load.in_flight) == ("sleeping", False, 0.0)
