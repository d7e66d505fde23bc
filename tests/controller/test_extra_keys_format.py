"""A worker whose vLLM hashes a block's extra keys as plain strings (releases before the domain tags) is learnt from
its first salted block 0, and its salted prompts route WARM; one of the tagged kind keeps the tagged form.

Before: kvfleet predicted the tagged form alone. The proxy salts every request with its tenant's salt, so against
an untagged vLLM every salted block 0 failed self-calibration (the worker's index dropped at each) and no salted
prompt was ever WARM there. fleet/core/block_hash.py says what each form hashes.
"""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest
from support.one_worker import synced

from controller.metrics import Metrics
from controller.router import Router, RouterConfig, WorkerSpec
from fleet.app.testkit.sim_vllm.config import SimEngineConfig
from fleet.app.testkit.sim_vllm.main import SimConfig, SimVllm
from fleet.cas import open_store

TOKS = list(range(2000, 2100))  # 6 full blocks of 16


@pytest.mark.parametrize("form", ["untagged", "tagged"])
async def test_a_salted_prompt_routes_warm_whichever_form_the_worker_hashes(tmp_path: Path, form: str) -> None:
    store = open_store(f"sqlite:///{tmp_path}/kv.db")
    sim = await SimVllm(SimConfig(engine=SimEngineConfig(model="m", num_blocks=256, hash_extra_keys=form))).start()
    r = Router(store, Metrics(), RouterConfig(reconcile_interval_s=0.1, http_timeout_s=10.0))
    await r.start()
    try:
        await r.register_worker(WorkerSpec("w0", sim.url, sim.kv_events, sim.replay, "m"))
        async with aiohttp.ClientSession() as h, h.post(sim.url + "/v1/completions",
                                                        json={"prompt": TOKS, "cache_salt": "tenant-a"}) as resp:
            assert resp.status == 200
        await synced(r, sim)
        w = r.worker("w0")
        assert w.calibrated and w.hash_cfg is not None and w.hash_cfg.extra_format == form  # before: not calibrated
        d = await r.route(TOKS, "m", cache_salt="tenant-a")
        assert (d.verdict, d.matched_tokens) == ("WARM", 96)
        other = await r.route(TOKS, "m", cache_salt="tenant-b")   # control: another salt's blocks are not these
        assert (other.verdict, other.matched_tokens) == ("COLD", 0)
    finally:
        await r.stop()
        await sim.stop()
        store.close()
