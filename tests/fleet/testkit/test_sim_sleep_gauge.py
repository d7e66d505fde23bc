"""The stand-in's sleep bookkeeping, as vLLM 0.33.0 keeps it (reference §4): `vllm:sleep_mode_operations_in_flight`
raised around the /sleep, /wake_up and /release_kv_cache_memory handlers, the sleep state set once a sleep has
completed, and each operation counted (the duration histogram's _count) when it ends, a release included. A /sleep
with mode=wait is still draining while a request runs: vLLM shows awake, with one sleep operation in flight."""

from __future__ import annotations

import asyncio

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from support.stand_ins import wait_sleep_under_a_request

from controller.vllm.http import parse_metrics
from fleet.app.testkit.sim_vllm.config import SimEngineConfig
from fleet.app.testkit.sim_vllm.main import SimConfig, SimVllm

AWAKE = {"awake": 1.0, "weights_offloaded": 0.0, "discard_all": 0.0}
OFFLOADED = {"awake": 0.0, "weights_offloaded": 1.0, "discard_all": 0.0}


async def _series(http: aiohttp.ClientSession, url: str) -> dict[tuple[str, str], float]:
    """(sample name, operation) -> value, for the sleep-mode families."""
    async with http.get(url + "/metrics") as r:
        text = await r.text()
    return {(s.name, s.labels.get("operation", "")): s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name.startswith("vllm:sleep_mode_")}


def _gauge(series: dict[tuple[str, str], float]) -> dict[str, float]:
    return {op: v for (n, op), v in series.items() if n == "vllm:sleep_mode_operations_in_flight"}


def _count(series: dict[tuple[str, str], float]) -> dict[str, float]:
    return {op: v for (n, op), v in series.items() if n == "vllm:sleep_mode_operation_duration_seconds_count"}


async def test_a_wait_sleep_draining_shows_awake_with_one_operation_in_flight() -> None:
    # a long request (200 tokens of 20 ms decode steps, real time); the drain ends when its client goes away
    cfg = SimEngineConfig(model="m", num_blocks=64, time_scale=1.0, decode_base_s=0.02)
    sim = await SimVllm(SimConfig(engine=cfg)).start()
    try:
        async with aiohttp.ClientSession() as http:
            assert await _series(http, sim.url) == {}  # created on the first sleep-mode call: absent != 0

            async with wait_sleep_under_a_request(http, sim, list(range(40))) as verb:
                for _ in range(500):
                    if sim.engine.is_sleeping():
                        break
                    await asyncio.sleep(0.01)
                draining = await _series(http, sim.url)
                m = parse_metrics(await (await http.get(sim.url + "/metrics")).text())
                async with http.get(sim.url + "/is_sleeping") as r:
                    sleeping = (await r.json())["is_sleeping"]
                assert not verb.done()
                # vLLM: the scheduler is paused (is_sleeping), the state is recorded once the sleep completes, the
                # gauge is up while the handler awaits it, and the duration is observed only then
                assert sleeping and m.sleep_state == AWAKE and m.in_flight == 1.0 and m.sleep_ops is None
                assert _gauge(draining) == {"sleep": 1.0, "wake": 0.0, "release_kv_cache_memory": 0.0}
                assert _count(draining) == {}
            # leaving it: the client goes away, its request is aborted, and the drain is done
            done = await _series(http, sim.url)
            m = parse_metrics(await (await http.get(sim.url + "/metrics")).text())
            assert m.sleep_state == OFFLOADED and m.in_flight == 0.0 and m.sleep_ops == 1.0
            assert _gauge(done)["sleep"] == 0.0 and _count(done) == {"sleep": 1.0}
    finally:
        await sim.stop()


async def test_wake_and_release_are_counted_when_they_end() -> None:
    sim = await SimVllm(SimConfig(engine=SimEngineConfig(model="m", num_blocks=64))).start()
    try:
        async with aiohttp.ClientSession() as http:
            for path, params in (("/release_kv_cache_memory", {}),  # refused (no pause): vLLM's engine raised
                                 ("/pause", {"mode": "keep", "clear_cache": "false"}),
                                 ("/release_kv_cache_memory", {}), ("/wake_up", {}), ("/sleep", {"level": "0"}),
                                 ("/wake_up", {})):
                async with http.post(sim.url + path, params=params) as r:
                    await r.read()
            s = await _series(http, sim.url)
            assert _count(s) == {"release_kv_cache_memory": 2.0, "wake": 2.0, "sleep": 1.0}
            assert _gauge(s) == {"sleep": 0.0, "wake": 0.0, "release_kv_cache_memory": 0.0}
            assert all(set(lab) == {"operation"} for f in text_string_to_metric_families(
                await (await http.get(sim.url + "/metrics")).text()) for s in f.samples
                if s.name.startswith("vllm:sleep_mode_") for lab in [
                    {k for k in s.labels if k != "le"}])  # the frontend's label alone
    finally:
        await sim.stop()
