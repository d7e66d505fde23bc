"""A lifecycle verb in flight when its worker is unregistered acts on nothing the controller keeps afterwards.

The index and the store are keyed by the worker's name, and a new registration may take the name at once. The
stopped Worker's verb used to carry on: when its answer came (or its call failed) it dropped the index of the
name, now the new registration's (whose warm prompt then routed COLD for good: vLLM announces a block once), and
wrote the old worker's rank state over the new one's record (serving=False, read back by a restarted
controller). Now a stopped Worker applies nothing, and the verb answers FailedPrecondition.

The old worker sits behind an HTTP front that can hold its /sleep answer, so the verb is caught at each stage:
waiting for routes decided before it (`settle`), waiting for vLLM's answer, and failing.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from support.http_stub import serving

from controller.cost import CostConfig
from controller.metrics import Metrics
from controller.router import Router, RouterConfig, WorkerSpec
from fleet.app.testkit.sim_vllm.config import SimEngineConfig
from fleet.app.testkit.sim_vllm.main import SimConfig, SimVllm
from fleet.cas import open_store
from fleet.core.block_hash import external_chain
from fleet.core.errors import FailedPrecondition

PROMPT = [7_000 + k for k in range(160)]  # 10 blocks


@contextlib.asynccontextmanager
async def _front(sim: SimVllm, held: asyncio.Event, answer: int) -> AsyncIterator[str]:
    """`sim`'s HTTP, except that /sleep waits for `held` and then is forwarded (answer 200) or answers `answer`."""
    async with aiohttp.ClientSession() as h:

        async def forward(req: web.Request) -> web.Response:
            if req.path == "/sleep":
                await held.wait()
                if answer != 200:
                    return web.Response(status=answer, text="engine error")
            async with h.request(req.method, sim.url + req.path_qs, data=await req.read(),
                                 headers={"Content-Type": req.content_type}) as resp:
                return web.Response(body=await resp.read(), status=resp.status, content_type=resp.content_type)

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", forward)
        async with serving(app) as url:
            yield url


async def _warm(r: Router, sim: SimVllm) -> None:
    async with aiohttp.ClientSession() as h, h.post(sim.url + "/v1/completions",
                                                    json={"prompt": PROMPT, "max_tokens": 1}) as resp:
        assert resp.status == 200
    for _ in range(300):
        cfg = r.worker("w0").view().hash_cfg
        if cfg is not None and r.index.match(("w0", 0), external_chain(cfg, PROMPT)) == 10:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the new w0 never indexed the prompt")


@pytest.mark.parametrize("stage, answer", [("settling", 200), ("answering", 200), ("failing", 500)])
async def test_a_verb_outliving_its_workers_unregistration_leaves_the_new_registration_alone(
    tmp_path, stage: str, answer: int
) -> None:
    old, new = [await SimVllm(SimConfig(engine=SimEngineConfig(model="m", num_blocks=64))).start() for _ in range(2)]
    store = open_store(f"sqlite:///{tmp_path}/kv.db")
    # settling: a tracked route decided just before the verb makes it wait the grace (2 s) before it calls vLLM
    grace = 2.0 if stage == "settling" else 0.25
    r = Router(store, Metrics(), RouterConfig(reconcile_interval_s=0.1, http_timeout_s=10.0,
                                              cost=CostConfig(reconcile_grace_s=grace)))
    await r.start()
    held = asyncio.Event()
    if stage == "settling":
        held.set()
    verb: asyncio.Task[object] | None = None
    try:
        async with _front(old, held, answer) as url:
            await r.register_worker(WorkerSpec("w0", url, old.kv_events, old.replay, "m"))
            if stage == "settling":
                await r.route(PROMPT, "m", track=True, owner="t")
            verb = asyncio.create_task(r.lifecycle("w0", "sleep", level=1))
            await asyncio.sleep(0.3)  # settling: waiting for the route; otherwise: its /sleep sent, held
            assert not verb.done()
            await r.unregister_worker("w0")
            await r.register_worker(WorkerSpec("w0", new.url, new.kv_events, new.replay, "m"))
            await _warm(r, new)
            before = await r.route(PROMPT, "m")
            assert (before.verdict, before.matched_tokens) == ("WARM", 160)  # control: warm before the verb ends
            held.set()
            (outcome,) = await asyncio.gather(verb, return_exceptions=True)
            await asyncio.sleep(0.3)  # three looks at the new w0
            after = await r.route(PROMPT, "m")
            # before: COLD, 0 blocks indexed while the stand-in held 10; the record said serving=False
            assert (after.worker, after.verdict, after.matched_tokens) == ("w0", "WARM", 160)
            assert r.index.num_resident(("w0", 0)) == 10 == len(new.engine.resident_external())
            record = await asyncio.to_thread(r.epochs.get, "w0", 0)
            mine = r.worker("w0").ranks[0]
            assert record is not None and (record.epoch, record.serving, record.phase) == (mine.epoch, True, "serving")
            # the verb's caller is told its outcome was not recorded (before: a witness, or the worker's error)
            assert isinstance(outcome, FailedPrecondition) and "unregistered" in str(outcome)
            # what reached the old vLLM: nothing while settling (the verb was not sent), the sleep once answered
            assert old.engine.is_sleeping() is (stage == "answering")
    finally:
        held.set()
        if verb is not None:
            with contextlib.suppress(Exception):
                await verb
        await r.stop()
        for s in (old, new):
            await s.stop()
        store.close()
