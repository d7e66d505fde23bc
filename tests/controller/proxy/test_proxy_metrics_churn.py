"""A worker unregistered while a request to it is still being answered gets no proxy /metrics series back when that
answer ends: the series it records then are swept at the next directory refresh (controller/proxy/server.py
`_sweep_metrics`), read from the real /metrics text as Prometheus scrapes it. A worker still registered keeps its own
(the control).

NOTE: before, the directory dropped the worker's series once, when it saw it gone; the request still running there
then counted its answer under the worker's name again (kvfleet_proxy_requests_total, the prompt and matched tokens,
the added-latency histogram: 20 series), and nothing ever removed them: every pod that went away while serving left
its series on /metrics for good.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families
from support.proxy_fleet import BLOCK, MODEL, Fleet, start_fleet, until
from support.stand_ins import runs_a_request

from fleet.app.testkit.sim_vllm.config import SimEngineConfig
from fleet.app.testkit.stack import register_sims, start_sims


async def _workers_on_metrics(fleet: Fleet) -> dict[str, int]:
    """worker label value -> how many series carry it, from the proxy's real GET /metrics."""
    async with fleet.http.get(fleet.proxy.url + "/metrics") as r:
        assert r.status == 200
        text = await r.text()
    seen: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if "worker" in s.labels:
                seen[s.labels["worker"]] = seen.get(s.labels["worker"], 0) + 1
    return seen


async def test_an_answer_ending_after_its_worker_left_leaves_no_series(tmp_path: Path) -> None:
    fleet = await start_fleet(tmp_path, num_workers=1, engine_kw={"time_scale": 1.0, "decode_base_s": 0.02})
    extra = await start_sims(1, SimEngineConfig(model=MODEL, block_size=BLOCK, num_blocks=512), prefix="pod-")
    try:
        body = {"model": MODEL, "max_tokens": 60, "messages": [{"role": "user", "content": "a long answer"}]}
        slow = asyncio.create_task(fleet.post("/v1/chat/completions", body))  # ~1.2 s on w0
        await until(lambda: asyncio.sleep(0, runs_a_request(fleet.sims["w0"])), bool)  # sent to w0, answering
        await register_sims(fleet.op, extra, MODEL, BLOCK)
        await fleet.op.unregister_worker("w0")
        await until(lambda: _listed(fleet), lambda names: names == {"pod-0"})
        # dropped when the directory saw it gone. NOTE: polled: on a loaded machine the answer still streaming from w0
        # (its first byte late) counted under w0 again between that refresh and this read (a fresh-clone run saw 2
        # series); the next refresh drops them, and the end of the test checks none is left after the answer ends
        await until(lambda: _workers_on_metrics(fleet), lambda seen: "w0" not in seen)
        status, headers, _ = await slow  # the answer w0 was giving ends now, and is counted under w0
        assert status == 200 and headers["x-kvfleet-worker"] == "w0"
        status, headers, _ = await fleet.post("/v1/chat/completions", {**body, "max_tokens": 2})
        assert status == 200 and headers["x-kvfleet-worker"] == "pod-0"
        after = time.monotonic()
        await until(lambda: _loaded_at(fleet), lambda t: t > after)  # a refresh has run since both answers ended
        seen = await _workers_on_metrics(fleet)
        print(f"series by worker after the refreshes: {seen}")
        assert "w0" not in seen
        assert seen.get("pod-0", 0) >= 20  # the control: the worker still registered keeps its series
    finally:
        await fleet.stop()
        for s in extra.values():
            await s.stop()


async def _listed(fleet: Fleet) -> set[str]:
    return set(fleet.proxy.directory.workers)


async def _loaded_at(fleet: Fleet) -> float:
    return fleet.proxy.directory.loaded_at or 0.0
