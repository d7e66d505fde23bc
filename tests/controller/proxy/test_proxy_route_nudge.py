"""A Route whose candidates leave out a worker with requests waiting on it nudges those waiters to probe now
(controller/proxy/watch.py `WorkerWatch.routed`): the controller learned the worker stopped serving (its reconcile,
a KV event) before the proxy's next listing. Real controller, stand-ins and proxy (support/proxy_fleet.py); one
stand-in holds its completions on cue (a request sent just as the worker is slept), then is slept for real.

NOTE: before, such waiters waited for the proxy's next listing (--refresh) or their own probe (--first-byte-timeout):
in the fleet-routing bench three turns sent just as a worker was slept waited 0.25 s each before failing over."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from aiohttp import web
from support.proxy_fleet import MODEL, start_fleet, until

PROMPT = {"model": MODEL, "prompt": "Tally the pallets in bay seven, then in bay eight. " * 8, "max_tokens": 2}
OTHER = {"model": MODEL, "prompt": "List the forklifts due for service this week.", "max_tokens": 2}


def _holds_on_cue(sim: Any) -> Any:
    """While `sim.hold` is set, the stand-in holds its completions (as a sleeping vLLM holds what it accepted)."""
    sim.hold = None

    @web.middleware
    async def middleware(req: web.Request, handler: Any) -> web.StreamResponse:
        if req.path == "/v1/completions" and sim.hold is not None:
            await sim.hold.wait()
        return await handler(req)  # type: ignore[no-any-return]

    return middleware


async def _sent_while_slept(tmp_path: Path, nudge: bool) -> tuple[int, dict[str, str], float, str]:
    # the proxy's own probe (20 s) and its listing (30 s) come too late to matter here
    fleet = await start_fleet(tmp_path, num_workers=2, reconcile_s=0.1, worker_middleware=_holds_on_cue,
                              first_byte_timeout_s=20.0, first_byte_min_s=20.0, refresh_s=30.0)
    try:
        s, h, raw = await fleet.post("/v1/completions", PROMPT)
        assert s == 200, raw
        w = h["x-kvfleet-worker"]
        sim = fleet.sims[w]
        sim.hold = asyncio.Event()  # type: ignore[attr-defined]
        t0 = time.monotonic()
        held = asyncio.ensure_future(fleet.post("/v1/completions", PROMPT))  # WARM on w, held there
        watch = fleet.proxy.directory.watch
        await until(lambda: asyncio.sleep(0, len(watch._tickets)), lambda n: n == 1)  # waiting for its first byte
        async with fleet.http.post(sim.url + "/sleep", params={"level": "1"}) as r:
            assert r.status == 200
        router = fleet.ctl.ctx.need_router()
        await until(lambda: asyncio.sleep(0, [r.serving for r in router.workers() if r.name == w]),
                    lambda on: on == [False])  # the controller knows (its reconcile); the proxy's listing does not
        if nudge:
            s2, h2, _ = await fleet.post("/v1/completions", OTHER)  # routed among the others: w left out
            assert s2 == 200 and h2["x-kvfleet-worker"] != w
        status, headers, _ = await asyncio.wait_for(held, 10.0)
        return status, headers, time.monotonic() - t0, w
    finally:
        for sim in fleet.sims.values():
            if getattr(sim, "hold", None) is not None:
                sim.hold.set()
        await fleet.stop()


async def test_a_route_that_leaves_a_worker_out_fails_its_waiters_over_now(tmp_path: Path) -> None:
    status, headers, took, slept = await _sent_while_slept(tmp_path, nudge=True)
    assert status == 200 and headers["x-kvfleet-worker"] != slept and headers["x-kvfleet-attempts"] == "2"
    assert took < 10.0  # its own probe would have come at 20 s


async def test_a_worker_left_out_is_nudged_once_a_ticket_and_only_for_its_own_model() -> None:
    """Control: an awake worker the controller stops routing to (a drain, an unhealthy look) is not probed at every
    later Route, only once while the same requests wait; a Route for another model, or one naming it, leaves it be."""
    from controller.proxy.watch import WorkerWatch

    watch = WorkerWatch()
    ticket = watch.ticket("w1", MODEL)
    watch.routed("another-model", {"w2"})  # w1 may not serve that model at all
    watch.routed(MODEL, {"w1", "w2"})  # named: serving
    assert watch.num_nudged == 0 and not ticket.wake.done()
    first = ticket.wake
    for _ in range(3):
        watch.routed(MODEL, {"w2"})
    assert watch.num_nudged == 1 and first.done() and not ticket.wake.done()  # woken once, a fresh wake armed
    assert watch.ticket("w1", MODEL) is ticket  # the same waiters: still once
