"""The store's own health on a real controller: the gRPC health service "kvfleet.store" and kvfleet_store_up
follow a real redis-server killed and restarted, and a Redis gone silent (a hung primary, a partition), while
the overall health, what readiness asks, stays as leadership set it (controller/store_probe.py says why).

NOTE: before, health was set by leadership alone: SERVING all through a Redis outage, with no other signal.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.controller import make_tokens, start_controller
from support.lossy_relay import SilentRelay

from controller.server import Controller
from controller.store_probe import STORE_HEALTH_SERVICE

HS = health_pb2.HealthCheckResponse


async def _status(ch: grpc.aio.Channel, service: str) -> int:
    r = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=3)
    return int(r.status)


async def _store_is(ctl: Controller, ch: grpc.aio.Channel, status: int, timeout_s: float) -> None:
    """Until "kvfleet.store" reads `status` and kvfleet_store_up agrees; the overall health stays SERVING."""
    deadline = time.monotonic() + timeout_s
    while await _status(ch, STORE_HEALTH_SERVICE) != status:
        assert time.monotonic() < deadline, f"{STORE_HEALTH_SERVICE} never became {HS.ServingStatus.Name(status)}"
        await asyncio.sleep(0.05)
    assert ctl.ctx.metrics.registry.get_sample_value("kvfleet_store_up") == (1.0 if status == HS.SERVING else 0.0)
    assert await _status(ch, "") == HS.SERVING


async def test_store_health_follows_a_redis_killed_and_restarted(redis_url: str, redis_server: object,
                                                                 tmp_path: Path) -> None:
    ctl = await start_controller(redis_url, make_tokens(tmp_path), store_ping_interval_s=0.1, gc_interval_s=0)
    try:
        async with grpc.aio.insecure_channel(ctl.address) as ch:
            await _store_is(ctl, ch, HS.SERVING, 3.0)
            redis_server.kill()  # type: ignore[attr-defined]
            await _store_is(ctl, ch, HS.NOT_SERVING, 3.0)
            redis_server.start()  # type: ignore[attr-defined]
            await _store_is(ctl, ch, HS.SERVING, 3.0)
    finally:
        await ctl.stop(0)


async def test_store_health_follows_a_redis_gone_silent(redis_url: str, tmp_path: Path) -> None:
    relay = SilentRelay(("127.0.0.1", int(redis_url.rsplit(":", 1)[1].split("/")[0])))
    ctl = await start_controller(f"redis://127.0.0.1:{relay.port}/0", make_tokens(tmp_path),
                                 store_ping_interval_s=0.1, gc_interval_s=0)
    try:
        async with grpc.aio.insecure_channel(ctl.address) as ch:
            await _store_is(ctl, ch, HS.SERVING, 3.0)
            relay.silent = True  # the probe's read waits (60 s socket timeout); it counts as failed at 2 s
            await _store_is(ctl, ch, HS.NOT_SERVING, 4.0)
            relay.silent = False  # the read in flight gets its answer
            await _store_is(ctl, ch, HS.SERVING, 3.0)
    finally:
        relay.silent = False
        await asyncio.wait_for(ctl.stop(0), 15)
        relay.close()


async def test_before_its_first_probe_answers_the_store_reads_unknown_not_not_found(redis_url: str) -> None:
    """NOTE: before, "kvfleet.store" was set only once a probe answered: a check in that moment got NOT_FOUND, as for
    a service the controller does not have (seen once in the silent-Redis test above, whose probes go through a relay)."""
    from grpc_health.v1.health import aio as health_aio

    from controller.metrics import Metrics
    from controller.store_probe import StoreProbe
    from fleet.cas import open_store

    relay = SilentRelay(("127.0.0.1", int(redis_url.rsplit(":", 1)[1].split("/")[0])))
    store, health = open_store(f"redis://127.0.0.1:{relay.port}/0"), health_aio.HealthServicer()
    relay.silent = True  # a real Redis store whose next read waits
    probe = StoreProbe(store, Metrics(), health, interval_s=5.0, timeout_s=5.0)
    try:
        await probe.start()
        await asyncio.sleep(0.05)  # the first probe has begun and waits on the store
        class Context:  # the servicer's only use of it: the NOT_FOUND of a service never set
            async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
                raise AssertionError(f"{STORE_HEALTH_SERVICE}: {code.name}")

        check = await health.Check(health_pb2.HealthCheckRequest(service=STORE_HEALTH_SERVICE), Context())
        assert check.status == HS.UNKNOWN
    finally:
        relay.silent = False  # the read in flight gets its answer
        await probe.stop()
        relay.close()


def test_the_probe_interval_is_a_flag_and_an_environment_variable(tmp_path: Path, capsys: Any) -> None:
    """NOTE: before, the interval was fixed at 5 s outside the tests (ControllerConfig only)."""
    from controller.main import config_from, main, parse_args

    assert config_from(parse_args([], {}), {}).store_ping_interval_s == 5.0
    assert config_from(parse_args(["--store-probe-interval", "0.5"], {}), {}).store_ping_interval_s == 0.5
    assert config_from(parse_args([], {"KVFLEET_STORE_PROBE_INTERVAL": "0"}), {}).store_ping_interval_s == 0.0
    assert main(["--store-probe-interval", "-1", "--store", f"sqlite:///{tmp_path}/x.db"], {}) == 2
    assert "--store-probe-interval" in capsys.readouterr().err
