"""A worker whose KV events never arrive while it computes prompts is reported (a warning, kvfleet_kv_events_silent):
its publisher is not where it was registered (a stand-in restarted on other event ports), so every route there stays
COLD. Real controller, stand-ins and proxy (support/proxy_fleet.py); the silent one is registered with an event
endpoint nothing publishes on. NOTE: before, such a worker was listed serving and nothing said why it never warmed."""

from __future__ import annotations

import asyncio
from pathlib import Path

from support.proxy_fleet import MODEL, start_fleet, until

from fleet.app.redis_server import free_port
from fleet.app.testkit.sim_vllm.config import SimEngineConfig
from fleet.app.testkit.sim_vllm.main import SimConfig, SimVllm

PROMPT = {"model": MODEL, "prompt": "Count the crates on dock four, then on dock five. " * 6, "max_tokens": 2}


async def test_a_worker_whose_events_never_arrive_is_reported_silent(tmp_path: Path) -> None:
    fleet = await start_fleet(tmp_path, num_workers=1, reconcile_s=0.1, router_kw={"events_silent_s": 0.3})
    lost = await SimVllm(SimConfig(engine=SimEngineConfig(model=MODEL, block_size=16, num_blocks=512))).start()
    try:
        await fleet.op.register_worker("lost", url=lost.url, kv_events=f"tcp://127.0.0.1:{free_port()}", replay="",
                                       model=MODEL)
        metrics = fleet.ctl.ctx.metrics.registry

        def silent(worker: str) -> float | None:
            return metrics.get_sample_value("kvfleet_kv_events_silent", {"worker": worker, "dp_rank": "0"})

        for _ in range(3):  # each worker reuses its cache (the same prompt, straight to it: hits from the second on)
            for url in (lost.url, fleet.sims["w0"].url):
                async with fleet.http.post(url + "/v1/completions", json=PROMPT) as r:
                    assert r.status == 200
            await asyncio.sleep(0.15)
        await until(lambda: asyncio.sleep(0, silent("lost")), lambda v: v == 1)
        assert silent("w0") is None  # control: its events arrive, so it is never reported
        await fleet.op.unregister_worker("lost")
        assert silent("lost") is None  # its series went with it
    finally:
        await lost.stop()
        await fleet.stop()


def test_silence_needs_hits_an_empty_index_and_time_and_ends_with_a_batch() -> None:
    from controller.vllm.silence import Silence

    s = Silence(after_s=1.0)
    assert not s.looked(0, 100.0, 0, now=0.0)  # the count starts
    assert not s.looked(0, 100.0, 0, now=5.0)  # no hits since: it reused nothing, so nothing says events are lost
    assert not s.looked(0, 150.0, 0, now=0.5) and not s.looked(1, None, 0, now=9.0)  # too soon; a worker without it
    assert not s.looked(0, 150.0, 3, now=6.0)  # the index holds its blocks: events arrive
    assert not s.looked(0, 150.0, 0, now=6.0) and s.looked(0, 160.0, 0, now=7.5)  # again from 6.0: silent at 7.5
    assert not s.looked(0, 170.0, 0, now=8.0)  # said once
    assert s.heard(0) and not s.heard(0)  # a batch ends it (once)
    assert not s.looked(0, 10.0, 0, now=9.0) and not s.looked(0, 20.0, 0, now=9.5)  # a new process: from 10 again
