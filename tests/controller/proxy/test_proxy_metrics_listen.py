"""--metrics-listen: the proxy's /metrics on a listener of its own, and a 404 on the tenant-facing port.

The proxy's series name every worker and count every tenant's requests (kvfleet_proxy_requests_total{worker}),
while GET /v1/workers answers a tenant 403. NOTE: before, GET /metrics on the tenant-facing port answered anyone who
could reach it, with no token, and there was no way to move it: with the option set the first test fails there
(the main port answers 200 with the series; ProxyConfig takes no metrics_listen). Without it, the main port still
serves /metrics (the control: a plain `kvfleet proxy` keeps working). A real controller, sim-vllm worker and proxy.
"""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.proxy_fleet import MODEL, Fleet, start_fleet

from controller.proxy.config import ProxyConfig
from controller.proxy.main import config_from, main, parse_args
from fleet.core.errors import InvalidArgument

BODY = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}


async def _get(fleet: Fleet, url: str, who: str | None = None) -> tuple[int, str]:
    async with fleet.http.get(url, headers=fleet.headers(who) if who else None) as r:
        return r.status, await r.text()


def _workers_named(text: str) -> set[str]:
    """The worker label values of the kvfleet_proxy_* series in a Prometheus text exposition."""
    return {s.labels["worker"] for f in text_string_to_metric_families(text) if f.name.startswith("kvfleet_proxy_")
            for s in f.samples if "worker" in s.labels}


async def test_metrics_listen_serves_metrics_there_alone(tmp_path: Path) -> None:
    fleet = await start_fleet(tmp_path, num_workers=1, metrics_listen="127.0.0.1:0")
    try:
        status, headers, _ = await fleet.post("/v1/chat/completions", BODY)
        assert status == 200
        worker = headers["x-kvfleet-worker"]
        assert fleet.proxy.metrics_port not in (0, fleet.proxy.port)
        for who in (None, "a"):  # no token, and a tenant's: the tenant-facing port serves no metrics
            status, text = await _get(fleet, fleet.proxy.url + "/metrics", who)
            assert status == 404, text
            assert worker not in text
            async with fleet.http.get(fleet.proxy.url + "/metrics") as r:
                err = (await r.json())["error"]  # vLLM's error shape, as the proxy's other errors
            assert (err["code"], err["type"]) == (404, "NotFoundError")
        status, text = await _get(fleet, fleet.proxy.metrics_url + "/metrics")
        assert status == 200
        assert worker in _workers_named(text)  # parsed: the kvfleet_proxy_* series of the request above
        status, _ = await _get(fleet, fleet.proxy.metrics_url + "/v1/models", "a")
        assert status == 404  # nothing else is served on the metrics listener
        status, _ = await _get(fleet, fleet.proxy.url + "/health")
        assert status == 200
    finally:
        await fleet.stop()


async def test_without_it_the_main_port_serves_metrics(tmp_path: Path) -> None:
    fleet = await start_fleet(tmp_path, num_workers=1)
    try:
        status, headers, _ = await fleet.post("/v1/chat/completions", BODY)
        assert status == 200
        assert fleet.proxy.metrics_url == fleet.proxy.url and fleet.proxy.metrics_port == 0
        status, text = await _get(fleet, fleet.proxy.url + "/metrics")
        assert status == 200 and headers["x-kvfleet-worker"] in _workers_named(text)
    finally:
        await fleet.stop()


async def test_the_metrics_listener_stops_with_the_proxy(tmp_path: Path) -> None:
    fleet = await start_fleet(tmp_path, num_workers=1, metrics_listen="127.0.0.1:0", shutdown_drain_s=0.0)
    url = fleet.proxy.metrics_url + "/metrics"
    await fleet.stop()
    async with aiohttp.ClientSession() as http:
        with pytest.raises(aiohttp.ClientConnectionError):
            await http.get(url)


def test_the_flag_and_its_environment_variable() -> None:
    assert config_from(parse_args(["--metrics-listen", "0.0.0.0:9401"], {})).metrics_listen == "0.0.0.0:9401"
    env = {"KVFLEET_PROXY_METRICS_LISTEN": "127.0.0.1:9401"}
    assert config_from(parse_args([], env)).metrics_listen == "127.0.0.1:9401"
    assert config_from(parse_args(["--metrics-listen", "127.0.0.1:9402"], env)).metrics_listen == "127.0.0.1:9402"
    assert config_from(parse_args([], {})).metrics_listen is None
    assert config_from(parse_args([], {"KVFLEET_PROXY_METRICS_LISTEN": ""})).metrics_listen is None


@pytest.mark.parametrize("value", ["9401", "127.0.0.1:abc", "127.0.0.1:99999", "127.0.0.1:"])
def test_a_bad_value_is_a_clear_error(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(InvalidArgument, match=r"--metrics-listen .* must be HOST:PORT"):
        ProxyConfig(controller="127.0.0.1:50051", metrics_listen=value)
    assert main(["--metrics-listen", value]) == 2  # `kvfleet proxy` exits 2 before it starts, naming the flag
    err = capsys.readouterr().err
    assert f"kvfleet proxy: error: --metrics-listen {value!r} must be HOST:PORT" in err


def test_the_same_address_as_listen_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="--metrics-listen '127.0.0.1:8000' must differ from --listen"):
        ProxyConfig(controller="127.0.0.1:50051", listen="127.0.0.1:8000", metrics_listen="127.0.0.1:8000")
