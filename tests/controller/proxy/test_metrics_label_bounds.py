"""No metric label takes a value a client chose: a tenant sending many distinct model names, paths, methods, tokens,
content part types, users, route models and LoRA names, and blob refs adds no series to the proxy's GET /metrics or the
controller's registry once each (bounded) outcome has been counted (docs/metrics.md, "Label bounds").

Real controller (auth on), one sim-vllm worker and the proxy on loopback (support/proxy_fleet.py). Two rounds of
distinct values: no label value anywhere may be one the client sent, and the second round, all new values, must add
fewer series than it sent values of one kind. A label fed by client input fails both (checked: the proxy's error
counter labelled by its message instead of its status fails the first, with 480 series naming the client's values).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from support.proxy_fleet import MODEL, Fleet, start_fleet

from fleet.core.errors import KvfleetError
from fleet.sdk import NO_RETRY, AsyncFleetClient

N = 30  # distinct values of each kind per round


def series(text: str) -> set[tuple[str, tuple[tuple[str, str], ...]]]:
    """Every (sample name, its labels) of a Prometheus text."""
    return {(s.name, tuple(sorted(s.labels.items())))
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def client_values(found: set[tuple[str, tuple[tuple[str, str], ...]]], tag: str) -> list[str]:
    """Label values carrying `tag`, the mark every value the client sent carries."""
    return sorted({f"{name}{{{k}={v!r}}}" for name, labels in found for k, v in labels if tag in v})


async def _proxy_round(f: Fleet, tag: str) -> None:
    chat = {"max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}
    sem = asyncio.Semaphore(8)

    async def send(i: int) -> None:
        v = f"{tag}{i}"
        async with sem:
            await f.post("/v1/chat/completions", {**chat, "model": v})  # unknown model: 404
            await f.post("/v1/completions", {"model": f"{MODEL}:{v}", "max_tokens": 1, "prompt": "x"})
            await f.post("/v1/chat/completions", {"model": MODEL, "max_tokens": 1, "user": v, "messages": [
                {"role": "user", "content": f"hello {v}"},
                {"role": "tool", "tool_call_id": v, "content": [{"type": v, "text": "y"}]}]})  # part type: 400
            await f.post("/v1/chat/completions", {**chat, "model": MODEL, "user": v})  # answered: 200
            async with f.http.get(f"{f.proxy.url}/v1/{v}", headers=f.headers()) as r:
                await r.read()
            async with f.http.request(v.upper(), f"{f.proxy.url}/v1/chat/completions", headers=f.headers()) as r:
                await r.read()
            async with f.http.post(f"{f.proxy.url}/v1/chat/completions", json={**chat, "model": MODEL},
                                   headers={"Authorization": f"Bearer {v}"}) as r:
                await r.read()

    await asyncio.gather(*(send(i) for i in range(N)))


async def _controller_round(tenant: AsyncFleetClient, tag: str) -> None:
    """Routes of unknown models and LoRA names, stats and gets of malformed refs (all at once: a route that finds no
    worker for its model waits for one shared look at the workers' adapters, controller/route_phases.py)."""

    async def one(call: Awaitable[object]) -> None:
        with contextlib.suppress(KvfleetError):
            await call

    await asyncio.gather(*(one(call) for i in range(N) for v in [f"{tag}{i}"] for call in (
        tenant.route([1, 2, 3], v), tenant.route([1, 2, 3], MODEL, lora=v), tenant.stat_blob(v), tenant.get_blob(v))))


async def _both(f: Fleet) -> tuple[set[tuple[str, tuple[tuple[str, str], ...]]], ...]:
    async with f.http.get(f.proxy.url + "/metrics") as r:
        assert r.status == 200
        proxy = await r.text()
    return series(proxy), series(generate_latest(f.ctl.ctx.metrics.registry).decode())


async def test_distinct_client_values_add_no_series(tmp_path: Path) -> None:
    f = await start_fleet(tmp_path, num_workers=1)
    tenant = AsyncFleetClient(f.ctl.address, token=f.tokens["a"], retry=NO_RETRY)
    try:
        await _proxy_round(f, "zq1v")
        await _controller_round(tenant, "zq1v")
        proxy1, ctl1 = await _both(f)
        await _proxy_round(f, "zq2v")
        await _controller_round(tenant, "zq2v")
        proxy2, ctl2 = await _both(f)
        print(f"proxy series {len(proxy1)} -> {len(proxy2)}, controller {len(ctl1)} -> {len(ctl2)}")
        assert client_values(proxy2 | ctl2, "zq") == []
        # the control: the rounds reached the counters (404s, 400s, 401s, 200s; the controller's failed RPCs)
        statuses = {dict(labels).get("status") for name, labels in proxy2 if name == "kvfleet_proxy_errors_total"}
        assert {"400", "401", "404"} <= statuses
        assert any(name == "kvfleet_proxy_requests_total" for name, _ in proxy2)
        assert {dict(labels)["method"] for name, labels in ctl2 if name == "kvfleet_rpc_errors_total"} >= {"Route"}
        # N new values of a kind under a label fed by them would add N series; a bounded outcome seen first in the
        # second round (a slow answer's probe, a reconcile's contained error) adds a few
        assert len(proxy2 - proxy1) < N and len(ctl2 - ctl1) < N, (proxy2 - proxy1, ctl2 - ctl1)
    finally:
        await tenant.close()
        await f.stop()
