"""One worker's bad state stays with that worker (issue #13 item 2; regressions).

A corrupt persisted record used to abort `Router.start` (so the controller could not start) or
make ListWorkers/GetFleet answer INTERNAL; a per-worker exception in the reconcile loop was
logged on every tick and counted nowhere.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import aiohttp
from support.controller import start_controller, store_url
from support.one_worker import warm

from controller.metrics import Metrics
from controller.router import Router, RouterConfig, WorkerSpec
from fleet.app.testkit.sim_vllm.config import SimEngineConfig
from fleet.app.testkit.sim_vllm.main import SimConfig, SimVllm
from fleet.cas import open_store
from fleet.sdk import NO_RETRY, AsyncFleetClient

TOKS = list(range(1000, 1100))  # 6 full blocks of 16


async def _sims(n: int) -> list[SimVllm]:
    return [await SimVllm(SimConfig(engine=SimEngineConfig(model="m", num_blocks=64))).start() for _ in range(n)]


def _spec(i: int, s: SimVllm) -> WorkerSpec:
    return WorkerSpec(f"w{i}", s.url, s.kv_events, s.replay, "m")


async def _complete(sim: SimVllm, toks: list[int]) -> None:
    async with aiohttp.ClientSession() as h, h.post(sim.url + "/v1/completions", json={"prompt": toks}) as r:
        assert r.status == 200


async def _until(cond, tries: int = 300) -> bool:  # type: ignore[no-untyped-def]
    for _ in range(tries):
        if cond():
            return True
        await asyncio.sleep(0.02)
    return False


def _errors(m: Metrics, where: str) -> float:
    return m.registry.get_sample_value("kvfleet_worker_errors_total", {"where": where}) or 0.0


async def test_corrupt_records_neither_abort_start_nor_fail_the_listing(tmp_path: Path) -> None:
    """w1's epoch is a string (ListWorkers used to answer INTERNAL), w2's phase is unknown
    (Router.start used to raise), 'junk' has an unreadable spec (skipped): w0 still routes WARM."""
    url = store_url("sqlite", tmp_path)
    sims = await _sims(3)
    store = open_store(url)
    r = Router(store, Metrics(), RouterConfig(reconcile_interval_s=0.1))
    await r.start()
    for i, s in enumerate(sims):
        await r.register_worker(_spec(i, s))
    await r.stop()
    good = json.loads(store.kv_get("epochs", "w1/0"))
    store.kv_put("epochs", "w1/0", json.dumps(dict(good, epoch="7")).encode())
    store.kv_put("epochs", "w2/0", json.dumps(dict(good, phase="bogus")).encode())
    store.kv_put("workers", "junk", b"{not json")
    store.close()
    ctl = await start_controller(url, None, start_router=True)
    try:
        router = ctl.ctx.router
        assert router is not None  # the controller started despite the bad records
        m = ctl.ctx.metrics
        assert _errors(m, "start") == 3  # w1 (bad type), w2 (bad phase), junk (bad spec): each counted
        async with AsyncFleetClient(ctl.address, retry=NO_RETRY) as c:
            listed = {w.name: w for w in await c.workers()}
            fleet = await c.fleet()
        assert sorted(listed) == sorted(w.name for w in fleet.workers) == ["w0", "w1", "w2"]
        assert await _until(lambda: all(s.serving for s in router.workers()))  # w1, w2 start cold, fresh
        await _complete(sims[0], TOKS)
        await warm(router, TOKS)  # NOTE: the events ingested AND w0's warmth proven (a busy machine sees them apart)
        d = await router.route(TOKS, "m")
        assert (d.worker, d.verdict) == ("w0", "WARM")
    finally:
        await ctl.stop(0)
        for s in sims:
            await s.stop()


async def test_a_worker_whose_state_raises_is_contained_counted_and_logged_once(
    tmp_path: Path, caplog
) -> None:  # type: ignore[no-untyped-def]
    sims = await _sims(2)
    store = open_store(store_url("sqlite", tmp_path))
    m = Metrics()
    r = Router(store, m, RouterConfig(reconcile_interval_s=0.05))
    await r.start()
    try:
        for i, s in enumerate(sims):
            await r.register_worker(_spec(i, s))
        bad = r.worker("w1")

        def boom(*a: object) -> bool:
            raise RuntimeError("state of w1 is bad")

        async def fetch_boom() -> None:
            raise RuntimeError("w1 reconcile is bad")

        # listing and routing: w1 lists as "error", w0 is untouched and routable
        bad.warmable = boom  # type: ignore[method-assign]
        rows = {s.name: s for s in r.workers()}
        assert (rows["w1"].phase, rows["w1"].serving, rows["w1"].warm) == ("error", False, False)
        assert rows["w0"].phase == "serving" and rows["w0"].serving
        assert (await r.route(TOKS, "m")).worker == "w0"
        assert _errors(m, "status") == 1 and _errors(m, "route") == 1
        loras, bad.loras = bad.loras, None  # type: ignore[assignment]  # state every route reads first
        assert (await r.route(TOKS, "m")).worker == "w0"
        bad.loras = loras
        # reconcile: every tick fails and is counted; the traceback is logged once
        caplog.set_level(logging.INFO, logger="controller.contain")
        bad.fetch = fetch_boom  # type: ignore[method-assign]
        assert await _until(lambda: _errors(m, "reconcile") >= 5)
        logged = [x for x in caplog.records if "reconcile failed" in x.getMessage()]
        assert len(logged) == 1 and logged[0].exc_info is not None
        assert not any(st.serving for st in bad.ranks.values())  # fails closed: marked down
        assert r.worker("w0").ranks[0].serving
        # recovery is news, and a new failure is logged again
        del bad.fetch
        assert await _until(lambda: "reconcile" not in bad.errors.failing)
        assert any("works again" in x.getMessage() for x in caplog.records)
    finally:
        await r.stop()
        store.close()
        for s in sims:
            await s.stop()
