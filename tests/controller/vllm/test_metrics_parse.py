"""parse_metrics reads only the series it needs: the same answer as parsing every line, at a fraction of the
cost. The reconcile parses each worker's /metrics on the controller's event loop every reconcile interval; a
vLLM server exports hundreds of histogram lines, and prometheus_client's parser took about 10 ms for 439 of
them on the project machine (0.5 ms once filtered): a pause of every route in flight, twice a second per
worker. Timing is in no test; this checks the filter keeps what is read and drops the rest."""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp import web
from support.http_stub import serving

import controller.vllm.http as vhttp
from controller.vllm.http import WorkerHttpError, parse_metrics, wanted_lines
from fleet.app.testkit.sim_vllm.config import SimEngineConfig
from fleet.app.testkit.sim_vllm.main import SimConfig, SimVllm

LE = ("0.001", "0.01", "0.1", "0.5", "1.0", "2.5", "10.0", "40.0", "160.0", "+Inf")


def _histograms(engine: str) -> list[str]:
    out = []
    for fam in ("e2e_request_latency_seconds", "time_to_first_token_seconds", "request_prompt_tokens",
                "sleep_mode_operation_duration_seconds"):
        out += [f"# HELP vllm:{fam} Histogram of {fam}.", f"# TYPE vllm:{fam} histogram"]
        lab = f'engine="{engine}",model_name="org/model-8B"'
        if fam.startswith("sleep_mode"):
            lab += ',operation="sleep"'
        out += [f'vllm:{fam}_bucket{{{lab},le="{le}"}} 3.0' for le in LE]
        out += [f"vllm:{fam}_count{{{lab}}} 3.0", f"vllm:{fam}_sum{{{lab}}} 1.5"]
    return out


def _full_parse(text: str, engine: str) -> vhttp.WorkerMetrics:
    """parse_metrics with every line handed to the Prometheus parser, as before the filter."""
    real = vhttp.wanted_lines
    vhttp.wanted_lines = lambda t: t
    try:
        return parse_metrics(text, engine)
    finally:
        vhttp.wanted_lines = real


@pytest.fixture
async def sim_text() -> str:
    sim = await SimVllm(SimConfig(engine=SimEngineConfig(model="m", num_blocks=64, time_scale=1.0))).start()
    try:
        async with aiohttp.ClientSession() as h:
            async with h.post(sim.url + "/v1/completions", json={"prompt": list(range(40)), "max_tokens": 2}) as r:
                assert r.status == 200
            async with h.post(sim.url + "/sleep?level=1") as r:
                assert r.status == 200
            async with h.get(sim.url + "/metrics") as r:
                return await r.text()
    finally:
        await sim.stop()


async def test_the_filtered_parse_reads_what_the_full_parse_reads_and_drops_the_rest(sim_text: str) -> None:
    other_engine = [line.replace('engine="0"', 'engine="1"') for line in sim_text.splitlines()
                    if line.startswith("vllm:") and 'engine="0"' in line]
    text = "\n".join([*sim_text.splitlines(), *other_engine, *_histograms("0"), *_histograms("1")]) + "\n"
    for engine in ("0", "1"):
        got = parse_metrics(text, engine)
        assert got == _full_parse(text, engine)
    got = parse_metrics(text, "0")
    assert got.sleep_state.get("awake") == 0 and got.num_gpu_blocks == 64 and got.block_size == 16
    assert got.sleep_ops == 1 + 3 and got.start_time is not None  # the stand-in's sleep + ours: _count; a bare gauge
    kept = wanted_lines(text).splitlines()
    assert not any("_bucket" in line or "_sum" in line or "time_to_first_token" in line for line in kept)
    assert len(kept) < len(text.splitlines()) / 4


@pytest.mark.parametrize("junk", ["<html><body>not found</body></html>\n", "hello\n"])
def test_text_that_is_not_prometheus_is_still_an_error(junk: str) -> None:
    with pytest.raises(WorkerHttpError, match="not Prometheus text"):
        parse_metrics(junk)


@pytest.mark.parametrize(
    "series, value",
    [
        ("vllm:num_requests_running", "NaN"),
        ("vllm:num_requests_waiting", "-3"),
        ("vllm:kv_cache_usage_perc", "+Inf"),
    ],
)
def test_a_load_gauge_that_is_not_a_finite_count_is_an_error(series: str, value: str) -> None:
    # Before, NaN came back as the load: routes compared NaN costs (the worker still got 6 of 20 routes in a
    # probe with one healthy peer), and once a route was tracked every reconcile of the in-flight ledger raised
    # (math.floor). Now the watcher's look fails ("unreachable or junk") and the worker is marked down, as for
    # text that is not Prometheus at all: the same probe sent all 20 to the healthy worker.
    good = f'# TYPE {series} gauge\n{series}{{engine="0",model_name="m"}} 1.0\n'
    assert parse_metrics(good) is not None
    with pytest.raises(WorkerHttpError, match=f"/metrics: {series} is "):
        parse_metrics(good.replace(" 1.0\n", f" {value}\n"))


async def test_a_worker_answer_past_the_bound_is_junk_read_no_further() -> None:
    # A worker's /metrics (or any answer the watcher reads) used to be read whole into the controller's memory
    big = "# junk\n" * (vhttp.MAX_ANSWER_BYTES // 7 + 2)

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=big, content_type="text/plain")

    async def is_sleeping(_: web.Request) -> web.Response:
        return web.json_response({"is_sleeping": False})

    async def version(_: web.Request) -> web.Response:
        return web.Response(body=b'{"version": "1"}', headers={"Content-Type": "application/json; charset=bogus"})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/is_sleeping", is_sleeping)
    app.router.add_get("/version", version)
    async with serving(app) as url, aiohttp.ClientSession() as s:
        http = vhttp.VllmHttp(url, s, timeout_s=30.0)
        assert await http.is_sleeping() is False  # control: an ordinary answer
        with pytest.raises(WorkerHttpError, match=f"/metrics: answer over {vhttp.MAX_ANSWER_BYTES} bytes"):
            await http.metrics()
        assert await http.version() == "1"  # a charset Python lacks: read as UTF-8, as aiohttp's text() did
