"""A vLLM server behind an external or hybrid DP load balancer runs DP ranks from dp_rank_start, not 0.

vLLM binds global rank r's KV-event PUB and replay at the configured port + r, every batch says
data_parallel_rank r, and /metrics labels the engine "r". Found by review: the spec could only say 0..dp_ranks-1,
so a `--data-parallel-rank 3` server's every batch was refused as another rank's (wrong_dp_rank) and its warm
prompts routed COLD, and its engine="3" series were never read.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
from support.controller import make_tokens, start_controller, store_url

from controller.registry import EpochTable, WorkerRegistry, WorkerSpec
from fleet.app.testkit.sim_vllm.config import SimEngineConfig
from fleet.app.testkit.sim_vllm.main import SimConfig, SimVllm, _parse
from fleet.cas import open_store
from fleet.core.errors import InvalidArgument
from fleet.sdk import AsyncFleetClient, table

PROMPT = list(range(100, 164))  # 64 tokens = 4 blocks of 16
OTHER = list(range(500, 564))


async def _complete(sim: SimVllm, prompt: list[int]) -> None:
    async with aiohttp.ClientSession() as h, h.post(sim.url + "/v1/completions",
                                                    json={"model": "m", "prompt": prompt, "max_tokens": 1}) as r:
        assert r.status == 200


async def _until(fn, pred, timeout_s: float = 5.0):  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not pred(r := await fn()) and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    return r


async def test_an_external_lb_rank_routes_warm_and_refuses_another_ranks_batch(tmp_path: Path) -> None:
    # Before the fix: register_worker had no dp_rank_start (TypeError); registered at the rank's own port, the
    # route stayed COLD on dp_rank 0 (its batches say 3: wrong_dp_rank) and /metrics' engine "3" was not read.
    sim = await SimVllm(SimConfig(engine=SimEngineConfig(model="m", block_size=16, num_blocks=64), dp_rank=3)).start()
    assert sim.publisher is not None and sim.publisher.endpoint.endswith(f":{int(sim.kv_events.rsplit(':', 1)[1]) + 3}")
    tok = make_tokens(tmp_path)
    ctl = await start_controller(store_url("sqlite", tmp_path), tok, start_router=True)
    try:
        async with AsyncFleetClient(ctl.address, token=tok.op) as op, AsyncFleetClient(ctl.address, token=tok.a) as a:
            info = await op.register_worker("w3", url=sim.url, kv_events=sim.kv_events, replay=sim.replay or "",
                                            model="m", dp_rank_start=3)
            assert info.dp_rank_start == 3 and [r.dp_rank for r in info.ranks] == [3]
            await _until(op.workers, lambda ws: all(w.serving for w in ws))
            cold = await a.route(PROMPT, model="m")
            assert (cold.worker, cold.dp_rank, cold.verdict) == ("w3", 3, "COLD")
            async with aiohttp.ClientSession() as h, h.post(sim.url + "/v1/completions", json={
                    "model": "m", "prompt": PROMPT, "max_tokens": 1, "cache_salt": cold.cache_salt}) as r:
                assert r.status == 200
            warm = await _until(lambda: a.route(PROMPT, model="m"), lambda d: d.verdict == "WARM")
            assert (warm.worker, warm.dp_rank, warm.verdict, warm.matched_tokens) == ("w3", 3, "WARM", 64)
            w = ctl.ctx.need_router().worker("w3")
            assert w.load.num_gpu_blocks == 64  # vllm:cache_config_info{engine="3"}: this rank's engine is read
            # fail closed: a rank-0 batch on rank 3's socket drops rank 3's index (vLLM never sends one there)
            sim.publisher.dp_rank = 0
            await _complete(sim, OTHER)
            st = await _until(op.workers, lambda ws: ws[0].ranks[0].epoch > warm.epoch)
            assert st[0].ranks[0].epoch == warm.epoch + 1 and st[0].ranks[0].num_blocks == 0
            assert ctl.ctx.metrics.epoch_bumps.labels("wrong_dp_rank")._value.get() == 1
            assert (await a.route(PROMPT, model="m")).verdict == "COLD"
    finally:
        await ctl.stop(0)
        await sim.stop()


def test_dp_rank_start_is_checked_and_named() -> None:
    ok = dict(name="w", url="http://h:8000", kv_events="tcp://h:5557", replay="tcp://h:5558", model="m")
    with pytest.raises(InvalidArgument, match="dp_rank_start must be an int >= 0"):
        WorkerSpec(**ok, dp_rank_start=-1)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="dp_rank_start must be an int >= 0"):
        WorkerSpec(**ok, dp_rank_start=True)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match=r"dp_rank_start 60000 \+ dp_ranks 2 overflow replay's port: .* 65559"):
        WorkerSpec(**{**ok, "kv_events": "tcp://h:10"}, dp_ranks=2, dp_rank_start=60000)  # type: ignore[arg-type]
    assert WorkerSpec(**ok, dp_ranks=2, dp_rank_start=59976).dp_rank_ids == range(59976, 59978)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="dp_rank_start must be >= 0, got -1"):
        table.register_worker("w", url="http://h:1", kv_events="tcp://h:2", dp_rank_start=-1)


def test_sim_vllm_dp_flags_are_checked_and_named(capsys: pytest.CaptureFixture[str]) -> None:
    assert _parse(["--data-parallel-size", "4", "--data-parallel-rank", "3"]).dp_rank == 3
    for argv, message in (
        (["--data-parallel-rank", "4", "--data-parallel-size", "4"], "--data-parallel-rank must be 0..3"),
        (["--data-parallel-rank", "-1"], "--data-parallel-rank must be 0..0"),
        (["--data-parallel-size", "0"], "--data-parallel-size must be >= 1"),
        (["--data-parallel-size", "8", "--data-parallel-rank", "7", "--kv-events-port", "65530"],
         "--kv-events-port 65530 \\+ --data-parallel-rank 7 = 65537 is past 65535"),
    ):
        with pytest.raises(SystemExit):
            _parse(argv)
        assert message.replace("\\", "") in capsys.readouterr().err


def test_a_hybrid_lb_nodes_ranks_persist_by_global_rank(tmp_path: Path) -> None:
    store = open_store(f"sqlite:///{tmp_path}/kv.db")
    try:
        spec = WorkerSpec("n1", "http://h:8000", "tcp://h:5557", None, "m", dp_ranks=2, dp_rank_start=4)
        WorkerRegistry(store).put(spec)
        assert [WorkerRegistry.decode(raw) for _, raw in WorkerRegistry(store).entries()] == [spec]
        assert sorted(EpochTable(store).next_epochs(spec)) == [4, 5]
        assert sorted(store.kv_scan("epochs")) == ["n1/4", "n1/5"]
    finally:
        store.close()
