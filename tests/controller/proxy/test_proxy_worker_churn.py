"""A worker that is unregistered leaves nothing behind in the controller or the proxy: no /metrics series that
names it, no per-worker entry (controller/router.py `_gauge`; the proxy's directory drops it and its metrics and
first-byte waits go). A worker that stays registered keeps its own (the control).

NOTE: before, every worker name ever registered kept 2 controller series (kvfleet_route_inflight_*) and 23 proxy
series (after 3 requests), a first-byte window and a ticket in the proxy, for good: Kubernetes pod names change
with every restart, so they grew with each rollout.
"""

from __future__ import annotations

from pathlib import Path

from prometheus_client import generate_latest
from support.proxy_fleet import BLOCK, MODEL, Fleet, start_fleet, until

from fleet.app.testkit.sim_vllm.config import SimEngineConfig
from fleet.app.testkit.stack import register_sims, start_sims


def _series(text: str, worker: str) -> list[str]:
    return [line for line in text.splitlines() if not line.startswith("#") and f'worker="{worker}"' in line]


async def _chat(fleet: Fleet, n: int) -> set[str]:
    served = set()
    for i in range(n):
        status, headers, _ = await fleet.post("/v1/chat/completions", {
            "model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": f"request {i}"}]})
        assert status == 200
        served.add(headers["x-kvfleet-worker"])
    return served


async def test_an_unregistered_worker_leaves_no_series_and_no_entries(tmp_path: Path) -> None:
    fleet = await start_fleet(tmp_path, num_workers=1)  # w0, unregistered below
    extra = await start_sims(1, SimEngineConfig(model=MODEL, block_size=BLOCK, num_blocks=512), prefix="pod-")
    proxy, router = fleet.proxy, fleet.ctl.ctx.need_router()
    try:
        assert await _chat(fleet, 3) == {"w0"}
        await register_sims(fleet.op, extra, MODEL, BLOCK)
        await until(lambda: _listed(fleet), lambda names: "pod-0" in names)
        await fleet.op.unregister_worker("w0")
        await until(lambda: _listed(fleet), lambda names: names == {"pod-0"})
        assert await _chat(fleet, 3) == {"pod-0"}
        ctl_text = generate_latest(router.metrics.registry).decode()
        proxy_text = proxy.metrics.render().decode()
        print(f"series naming w0: controller {len(_series(ctl_text, 'w0'))}, proxy {len(_series(proxy_text, 'w0'))}; "
              f"naming pod-0: controller {len(_series(ctl_text, 'pod-0'))}, proxy {len(_series(proxy_text, 'pod-0'))}")
        assert _series(ctl_text, "w0") == [] and _series(proxy_text, "w0") == []
        assert "w0" not in proxy.forwarder.first_bytes._waits and "w0" not in proxy.directory.watch._tickets
        # the control: the worker still registered keeps its series and its window
        assert len(_series(ctl_text, "pod-0")) == 2 and len(_series(proxy_text, "pod-0")) == 23
        assert len(proxy.forwarder.first_bytes._waits["pod-0"]) == 3
    finally:
        await fleet.stop()
        for s in extra.values():
            await s.stop()


async def test_a_worker_unregistered_with_a_route_in_flight_gets_no_series_back(tmp_path: Path) -> None:
    """Its tracked routes end with the unregistration; ending them set its gauges again (for rank 0)."""
    fleet = await start_fleet(tmp_path, num_workers=1)
    router = fleet.ctl.ctx.need_router()
    try:
        d = await router.route(list(range(64)), MODEL, track=True)  # never released
        assert d.worker == "w0" and router.metrics.registry.get_sample_value("kvfleet_route_inflight_requests", {"worker": "w0"}) == 1
        await fleet.op.unregister_worker("w0")
        assert _series(generate_latest(router.metrics.registry).decode(), "w0") == []
    finally:
        await fleet.stop()


async def _listed(fleet: Fleet) -> set[str]:
    return set(fleet.proxy.directory.workers)
