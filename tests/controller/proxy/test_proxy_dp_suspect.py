"""A data-parallel worker found asleep behind the controller's back: the proxy's mark, and the controller's routes to
it once the controller has seen it sleep and wake."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from support.dp_front import dp_front, free_pair
from support.proxy_fleet import start_fleet, until

from fleet.app.testkit.sim_vllm.config import SimEngineConfig
from fleet.app.testkit.sim_vllm.main import SimConfig, SimVllm

DP_MODEL = "dp-model"
PROMPT = "Summarise the quarterly report for the board, section by section, with numbers. " * 3


async def test_a_woken_dp_worker_is_routed_to_under_its_trailing_ranks_epoch(tmp_path: Path) -> None:
    """A DP=2 worker, the only one of its model, whose rank 1 has stepped its epoch three times more than rank 0 (its
    own cache resets: each rank steps on its own clears). Slept behind the controller's back, the proxy finds it
    asleep and marks it; the controller sees the sleep and the wake, and routes to rank 0 under rank 0's new epoch.
    The mark kept one epoch, the newest of any rank's (rank 1's), which rank 0's new one did not pass: the proxy
    answered 503 ("a worker skipped") until its next listing refresh (refresh_s; 30 s here, 1 s by default)."""
    fleet = await start_fleet(tmp_path, num_workers=1, reconcile_s=0.2, refresh_s=30.0, suspect_s=30.0)
    p = free_pair()
    cfg = {"model": DP_MODEL, "block_size": 16, "num_blocks": 256}
    e0 = await SimVllm(SimConfig(engine=SimEngineConfig(**cfg), kv_events_port=p, replay_port=None)).start()
    e1 = await SimVllm(SimConfig(engine=SimEngineConfig(**cfg), kv_events_port=p + 1, replay_port=None)).start()
    assert e1.publisher is not None
    e1.publisher.dp_rank = 1
    body = {"model": DP_MODEL, "prompt": PROMPT, "max_tokens": 2}
    try:
        async with dp_front(e0, e1) as url:
            await fleet.op.register_worker("dp", url=url, kv_events=e0.kv_events, model=DP_MODEL, dp_ranks=2)
            await until(fleet.op.workers, lambda ws: any(w.name == "dp" and w.serving for w in ws))
            await _rank_1_heard(fleet, e1, body)
            for k in range(3):  # rank 1's engine resets its cache; its next step publishes the clear
                async with fleet.http.post(e1.url + "/reset_prefix_cache") as r:
                    assert r.status == 200
                async with fleet.http.post(e1.url + "/v1/completions", json={**body, "prompt": "x"}) as r:
                    assert r.status == 200
                await until(fleet.op.workers, lambda ws, k=k: _ranks(ws)[1] > _ranks(ws)[0] + k)
            for _ in range(5):
                await fleet.proxy.directory.refresh()  # the proxy lists both ranks' epochs
                async with fleet.http.post(url + "/sleep?level=1") as r:  # NOT through the controller
                    assert r.status == 200
                s, _, raw = await fleet.post("/v1/completions", body)
                if b"controller: no serving worker" not in raw:  # (the proxy's own 503 says "no serving worker answered")
                    break
                # NOTE: the controller's look (every 0.2 s here) saw the sleep before the request came (a loaded
                # machine, a fresh-clone run): it refused the route, and the proxy never met the sleeper. Again.
                async with fleet.http.post(url + "/wake_up") as r:
                    assert r.status == 200
                await until(fleet.op.workers, lambda ws: next(w for w in ws if w.name == "dp").serving)
            assert s == 503 and b"a worker asleep" in raw  # control: routed to the sleeper, found asleep, marked
            assert fleet.proxy.directory.is_suspect("dp")
            await until(fleet.op.workers, lambda ws: not next(w for w in ws if w.name == "dp").serving)
            async with fleet.http.post(url + "/wake_up") as r:  # still behind its back
                assert r.status == 200
            ws = await until(fleet.op.workers, lambda ws: next(w for w in ws if w.name == "dp").serving)
            s, h, raw = await fleet.post("/v1/completions", body)
            print(f"woken, the controller lists rank epochs {_ranks(ws)}; the proxy, its listing unrefreshed: {s} "
                  f"{raw[:120]!r}")
            assert s == 200 and h["x-kvfleet-worker"] == "dp", raw  # before: 503, dp skipped until the refresh
            assert int(h["x-kvfleet-epoch"]) == _ranks(ws)[0] < _ranks(ws)[1]  # rank 0's: the trailing rank
    finally:
        await fleet.stop()
        await e0.stop()
        await e1.stop()

async def _rank_1_heard(fleet: Any, e1: SimVllm, body: dict[str, Any]) -> None:
    """Until the controller has read a batch of rank 1's (a prompt of full blocks, so the step publishes one): its SUB
    socket connects some time after the registration, and a batch published before that is lost (ZMQ PUB drops it; no
    replay here). NOTE: on a loaded machine the
    first reset's clear went out before the socket was connected and the epoch never stepped (seen once in a
    fresh-clone run). NOTE: each try's prompt is new: the same prompt every try was cached after the first, so
    only the first published a batch, and when that one was lost no later try published any (a fresh-clone run)."""
    for i in range(100):
        warm = {**body, "prompt": f"warm up the stream {i} " * 20}
        async with fleet.http.post(e1.url + "/v1/completions", json=warm) as r:
            assert r.status == 200
        ws = await fleet.op.workers()
        if next(r for w in ws if w.name == "dp" for r in w.ranks if r.dp_rank == 1).last_seq >= 0:
            return
        await asyncio.sleep(0.1)
    raise AssertionError("the controller never read a batch of rank 1's")


def _ranks(ws) -> dict[int, int]:  # noqa: ANN001
    return {r.dp_rank: r.epoch for r in next(w for w in ws if w.name == "dp").ranks}
