"""A data-parallel worker's load is read per rank: vLLM's API server exports each engine's series labelled
engine="<rank>", and rank r's cost reads engine r's running, waiting and KV usage. Before, the watcher parsed
engine 0's series alone and every rank was charged them: a busy engine 0 priced an idle rank 1 out of the
prompt it held warm.

One DP=2 vLLM is emulated by two stand-ins behind one HTTP front: the first is the API server and engine 0
(rank 0's KV events at port P), the second engine 1 (its publisher at P + 1, vLLM's per-rank port, stamping
data_parallel_rank=1). The front answers /metrics with both engines' series, the second's labelled engine="1",
as vLLM's server does, and forwards everything else to the first."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
from support.dp_front import dp_front, free_pair

from controller.metrics import Metrics
from controller.router import Router, RouterConfig, WorkerSpec
from controller.vllm.http import WorkerMetrics, parse_engines, parse_metrics
from fleet.app.testkit.sim_vllm.config import SimEngineConfig
from fleet.app.testkit.sim_vllm.main import SimConfig, SimVllm
from fleet.cas import open_store

PROMPT = [3_000_000 + k for k in range(20 * 16)]  # 20 blocks


def test_each_engines_series_are_its_own() -> None:
    text = (
        'vllm:num_requests_running{engine="0",model_name="m"} 2.0\n'
        'vllm:num_requests_waiting{engine="0",model_name="m"} 8.0\n'
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5\n'
        'vllm:num_requests_running{engine="1",model_name="m"} 1.0\n'
        'vllm:num_requests_waiting{engine="1",model_name="m"} 0.0\n'
        'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25\n'
        "process_start_time_seconds 7.0\n"
    )
    e0, e1, e2 = parse_engines(text, (0, 1, 2))
    assert (e0.running, e0.waiting, e0.kv_usage) == (2.0, 8.0, 0.5)
    assert (e1.running, e1.waiting, e1.kv_usage) == (1.0, 0.0, 0.25)
    assert e0.start_time == e1.start_time == e2.start_time == 7.0  # unlabelled: the process's, every engine's
    assert e2 == WorkerMetrics(start_time=7.0)  # no series of engine 2: idle, nothing known
    assert (e0, e1) == (parse_metrics(text, "0"), parse_metrics(text, "1"))


async def _load(url: str, n: int) -> list[asyncio.Task[None]]:
    async def one(i: int) -> None:
        async with aiohttp.ClientSession() as h, h.post(
                url + "/v1/completions", json={"prompt": [100_000 * (i + 1) + k for k in range(64)],
                                               "max_tokens": 300}) as resp:
            await resp.read()
    return [asyncio.create_task(one(i)) for i in range(n)]


async def _until(what: str, ok: object) -> None:
    for _ in range(500):
        if ok():  # type: ignore[operator]
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never: {what}")


async def _stop(tasks: list[asyncio.Task[None]]) -> None:
    for t in tasks:
        t.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await t


async def test_a_busy_engine_0_does_not_price_rank_1_out_of_its_warm_prompt(tmp_path) -> None:
    P = free_pair()
    # each engine decodes 2 requests at a time, 6 s each here: 10 sent at once leave 2 running, 8 waiting
    slow = dict(model="m", num_blocks=256, time_scale=1.0, max_num_seqs=2, decode_base_s=0.02)
    e0 = await SimVllm(SimConfig(engine=SimEngineConfig(**slow), kv_events_port=P, replay_port=None)).start()  # type: ignore[arg-type]
    e1 = await SimVllm(SimConfig(engine=SimEngineConfig(**slow), kv_events_port=P + 1, replay_port=None)).start()  # type: ignore[arg-type]
    e1.publisher.dp_rank = 1
    other = await SimVllm(SimConfig(engine=SimEngineConfig(model="m", num_blocks=256))).start()
    store = open_store(f"sqlite:///{tmp_path}/kv.db")
    r = Router(store, Metrics(), RouterConfig(reconcile_interval_s=0.1))
    await r.start()
    busy: list[asyncio.Task[None]] = []
    try:
        async with dp_front(e0, e1) as url:
            await r.register_worker(WorkerSpec("dp", url, e0.kv_events, None, "m", dp_ranks=2))
            await r.register_worker(WorkerSpec("w1", other.url, other.kv_events, other.replay, "m"))
            async with aiohttp.ClientSession() as h, h.post(e1.url + "/v1/completions",
                                                            json={"prompt": PROMPT, "max_tokens": 1}) as resp:
                assert resp.status == 200  # rank 1 holds the prompt
            await _until("rank 1 indexed", lambda: r.index.num_resident(("dp", 1)) == 20)
            busy = await _load(e0.url, 10)
            await _until("engine 0 busy", lambda: (r.worker("dp").view().load.running,
                                                   r.worker("dp").view().load.waiting) == (2.0, 8.0))
            d = await r.route(PROMPT, "m")
            cost = {(c.worker, c.dp_rank): c.cost for c in d.candidates}
            # rank 1 idle and warm: 0. Before, engine 0's 2 running and 8 waiting were charged to it too (queued
            # 8 x 256, active 10: 0.25 x 2048 + 16 x 10 = 672), and the prompt went COLD to w1 (320)
            assert (d.worker, d.dp_rank, d.verdict, d.cost.total) == ("dp", 1, "WARM", 0)
            c0 = cost[("dp", 0)]
            assert c0 is not None and (c0.queued_tokens, c0.active_requests, c0.total) == (2048, 10, 320 + 672)
            listed = {(s.name, s.dp_rank): s.load for s in r.workers()}
            assert listed[("dp", 0)] == 10 and listed[("dp", 1)] == 0
            # control: the same load on engine 1 is rank 1's own, and then the prompt does leave it
            await _stop(busy)
            busy = await _load(e1.url, 10)
            await _until("engine 1 busy", lambda: (r.worker("dp").view().rank_load(1).running,
                                                   r.worker("dp").view().rank_load(1).waiting) == (2.0, 8.0))
            d = await r.route(PROMPT, "m")
            c1 = next(c.cost for c in d.candidates if (c.worker, c.dp_rank) == ("dp", 1))
            assert c1 is not None and (c1.queued_tokens, c1.active_requests, c1.total) == (2048, 10, 672)
            assert d.verdict == "COLD" and (d.worker, d.dp_rank) != ("dp", 1)
    finally:
        await _stop(busy)
        await r.stop()
        for s in (e0, e1, other):
            await s.stop()
        store.close()
