"""The proxy releases each route when its answer ends (done, a worker's error, or the client leaving),
so the controller's in-flight count for the worker falls at once rather than at a /metrics look.

The fleets here use a 30 s reconcile grace: no /metrics look may end a route, only the release.
"""

from __future__ import annotations

from pathlib import Path

from support.proxy_fleet import LONG_CONTEXT, MODEL, proxy_released, start_fleet, until

from controller.cost import CostConfig
from controller.router import Router

NO_RECONCILE = CostConfig(reconcile_grace_s=30.0)


async def _flights(router: Router) -> int:
    return len(router.flights)


async def test_answers_and_worker_errors_release_their_routes(tmp_path: Path) -> None:
    fleet = await start_fleet(tmp_path, cost=NO_RECONCILE)
    try:
        router = fleet.ctl.ctx.need_router()
        for i in range(3):
            status, _, _ = await fleet.post(
                "/v1/completions", {"model": MODEL, "prompt": f"hi {i}", "max_tokens": 4}
            )
            assert status == 200
        status, _, body = await fleet.post(
            "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": "many"}
        )
        assert status == 400, body  # the worker's own error answer, relayed
        await until(lambda: _flights(router), lambda n: n == 0)
        await proxy_released(fleet, 4)
        assert router.metrics.route_releases.labels("released")._value.get() == 4
        assert (
            router.metrics.inflight_dropped.labels("reconcile")._value.get() == 0
        )  # control: not by reconcile
    finally:
        await fleet.stop()


async def test_a_stream_is_in_flight_until_the_client_leaves(tmp_path: Path) -> None:
    fleet = await start_fleet(tmp_path, cost=NO_RECONCILE, engine_kw=LONG_CONTEXT)
    try:
        router = fleet.ctl.ctx.need_router()
        body = {"model": MODEL, "prompt": "Count to a million.", "max_tokens": 100_000, "stream": True}
        async with fleet.http.post(
            fleet.proxy.url + "/v1/completions", json=body, headers=fleet.headers()
        ) as r:
            worker = r.headers["x-kvfleet-worker"]
            await r.content.readuntil(b"\n\n")
            n, _, _ = router.flights.load((worker, 0))
            assert n == 1 and router.metrics.registry.get_sample_value("kvfleet_route_inflight_requests", {"worker": worker}) == 1
            d = await fleet.op.route([1, 2, 3], model=MODEL)  # what a route sees meanwhile
            costs = {c.worker: c.cost for c in d.candidates}
            assert costs[worker] is not None and costs[worker].active_requests == 1
            r.close()  # the client leaves mid-stream
        await until(lambda: _flights(router), lambda k: k == 0)
        assert router.metrics.registry.get_sample_value("kvfleet_route_inflight_requests", {"worker": worker}) == 0
        await proxy_released(fleet, 1)
        print(
            f"a 100000-token stream held 1 route in flight on {worker}; the client left and the proxy released it"
        )
    finally:
        await fleet.stop()


async def test_a_route_answered_after_its_client_left_is_released(tmp_path: Path) -> None:
    """The controller routes while the client goes away (its Route held until then): the answer comes over the
    RouteStream after the proxy's handler was cancelled, and the proxy releases that route at once. NOTE: before,
    the late answer was dropped and the route stayed in flight until a /metrics look (reconcile) dropped it (review
    finding); here no look may, so it stayed for good. The control is the router's own count of routes made."""
    import asyncio

    import aiohttp

    fleet = await start_fleet(tmp_path, cost=NO_RECONCILE)
    try:
        router = fleet.ctl.ctx.need_router()
        route, go, entered = router.route, asyncio.Event(), asyncio.Event()

        async def held(*a: object, **kw: object) -> object:
            entered.set()
            await go.wait()
            return await route(*a, **kw)

        router.route = held  # type: ignore[method-assign]
        body = {"model": MODEL, "prompt": "a route nobody waits for", "max_tokens": 4}
        post = asyncio.ensure_future(fleet.http.post(fleet.proxy.url + "/v1/completions", json=body,
                                                     headers=fleet.headers(),
                                                     timeout=aiohttp.ClientTimeout(total=30)))
        await asyncio.wait_for(entered.wait(), 10)
        post.cancel()                                     # the client goes away while the controller routes
        await asyncio.sleep(0.3)                          # the proxy's handler is cancelled meanwhile
        go.set()

        async def made() -> float:
            return router.metrics.registry.get_sample_value("kvfleet_route_total", {"verdict": "COLD"}) or 0.0

        await until(made, lambda n: n == 1)              # the controller made the route (control: it did)
        await until(lambda: _flights(router), lambda n: n == 0)
        await proxy_released(fleet, 1)
        print(f"routes made {await made()}, released by the proxy 1, dropped by reconcile "
              f"{router.metrics.inflight_dropped.labels('reconcile')._value.get()}")
        assert router.metrics.inflight_dropped.labels("reconcile")._value.get() == 0
    finally:
        await fleet.stop()
