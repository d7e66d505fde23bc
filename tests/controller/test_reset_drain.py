"""A prefix-cache reset asked through the controller while the worker is busy drains it, then resets (issue #27).

vLLM answers /reset_prefix_cache with success:false, changing nothing, while requests hold blocks. The controller
used to ask once: the witness was "unknown", the rank's index was dropped although the cache was whole, and the
router went on sending the worker requests (cold) that kept the reset refused. Now the verb keeps the worker out
of routing and asks again until the reset succeeds or --reset-drain-timeout passes. The real Router on two
`kvfleet sim-vllm` workers with a clock; the control asks once (timeout 0), as before.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from controller.metrics import Metrics
from controller.router import Router, RouterConfig, WorkerSpec
from fleet.app.testkit.sim_vllm.config import SimEngineConfig
from fleet.app.testkit.sim_vllm.main import SimConfig, SimVllm
from fleet.cas import open_store

HISTORY = list(range(1000, 1100))  # 6 full blocks
OTHER = list(range(5000, 5100))
DECODE_S = 0.04
MAX_TOKENS = 20  # the busy request holds its blocks for about MAX_TOKENS * DECODE_S = 0.8 s


async def _busy(url: str) -> int:
    """A streamed request that decodes for about 0.8 s; its status once it ended."""
    body = {"prompt": HISTORY, "max_tokens": MAX_TOKENS, "stream": True}
    async with aiohttp.ClientSession() as h, h.post(url + "/v1/completions", json=body) as resp:
        async for _ in resp.content:
            pass
        return resp.status


@pytest.mark.parametrize("drain_s", [10.0, 0.0])
async def test_a_reset_of_a_busy_worker_waits_for_it_to_drain_and_routes_elsewhere_meanwhile(
    tmp_path, drain_s: float
) -> None:
    store = open_store(f"sqlite:///{tmp_path}/kv.db")
    eng = SimEngineConfig(model="m", num_blocks=64, time_scale=1.0, decode_base_s=DECODE_S)
    sims = [await SimVllm(SimConfig(engine=eng)).start() for _ in range(2)]
    r = Router(store, Metrics(), RouterConfig(reconcile_interval_s=0.1, reset_drain_s=drain_s))
    await r.start()
    try:
        for i, sim in enumerate(sims):
            await r.register_worker(WorkerSpec(f"w{i}", sim.url, sim.kv_events, sim.replay, "m"))
        busy = asyncio.create_task(_busy(sims[0].url))
        for _ in range(200):  # until the engine holds the request's blocks
            if sims[0].engine.running:
                break
            await asyncio.sleep(0.01)
        assert sims[0].engine.running

        t0 = time.monotonic()
        verb = asyncio.create_task(r.lifecycle("w0", "reset_prefix_cache"))
        await asyncio.sleep(0.05)
        if drain_s:
            assert not verb.done()  # still draining: w0 takes nothing new
            d = await r.route(OTHER, "m")
            assert d.worker == "w1"
        w = await verb
        took = time.monotonic() - t0
        assert await busy == 200  # the request in flight was never cut short

        drains = r.metrics.reset_drains
        if drain_s:
            assert w.kv == "forgotten" and w.serving  # it reset, once the request had ended
            assert 0.3 < took < 5.0
            assert drains.labels("reset")._value.get() == 1
            assert not sims[0].engine.running and not sims[0].engine.waiting
        else:  # control: asked once, refused, nothing changed in vLLM but the controller cannot know it
            assert w.kv == "unknown"
            assert took < 0.3
            assert drains.labels("reset")._value.get() == 0 and drains.labels("refused")._value.get() == 0
    finally:
        await r.stop()
        for sim in sims:
            await sim.stop()


def test_a_bad_drain_timeout_is_refused_before_anything_starts(tmp_path, capsys) -> None:
    from controller.main import main

    for bad in ("-1", "nan", "inf"):
        assert main(["--reset-drain-timeout", bad, "--store", f"sqlite:///{tmp_path}/x.db", "--metrics-port", "-1"],
                    {}) == 2
        assert "--reset-drain-timeout" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # not a number: argparse's usage error
        main(["--store", f"sqlite:///{tmp_path}/x.db"], {"KVFLEET_RESET_DRAIN_TIMEOUT": "soon"})
    assert not (tmp_path / "x.db").exists()
