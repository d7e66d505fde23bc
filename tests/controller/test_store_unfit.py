"""A running controller's Redis turned into one that evicts keys (maxmemory-policy allkeys-*: set on it, or another
Redis behind its address), which the store refuses at open (fleet/cas/redis.py): the store probe finds it, logs the
error the open gives, and the gRPC health of the store and the controller read NOT_SERVING until the policy is fixed
(controller/store_probe.py).

NOTE: before, only an open checked the policy: health stayed SERVING while one tenant's puts evicted another's blobs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.controller import make_tokens, start_controller

from controller.store_probe import STORE_HEALTH_SERVICE
from fleet.core.errors import FailedPrecondition
from fleet.sdk import NO_RETRY, AsyncFleetClient

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture
def policy(redis_url: str) -> Iterator[redis.Redis]:
    r = redis.Redis.from_url(redis_url)
    yield r
    r.config_set("maxmemory-policy", "noeviction")
    r.close()


async def _health(address: str) -> tuple[int, int]:
    async with grpc.aio.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        store = await stub.Check(health_pb2.HealthCheckRequest(service=STORE_HEALTH_SERVICE), timeout=3)
        overall = await stub.Check(health_pb2.HealthCheckRequest(), timeout=3)
        return store.status, overall.status


async def _until_health(address: str, want: tuple[int, int], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (seen := await _health(address)) != want:
        assert time.monotonic() < deadline, f"health (store, overall) {seen}, not {want}"
        await asyncio.sleep(0.05)


async def test_an_evicting_redis_under_a_running_controller_is_not_serving(
        redis_url: str, policy: redis.Redis, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, "kvfleet.controller.store")
    tokens = make_tokens(tmp_path)
    ctl = await start_controller(redis_url, tokens, store_ping_interval_s=0.1, gc_interval_s=0)
    try:
        async with AsyncFleetClient(ctl.address, token=tokens.a, retry=NO_RETRY) as c:
            await _until_health(ctl.address, (SERVING, SERVING))
            policy.config_set("maxmemory-policy", "allkeys-lru")
            await _until_health(ctl.address, (NOT_SERVING, NOT_SERVING))  # before: SERVING, SERVING
            assert "evicts keys when it is full (maxmemory-policy allkeys-lru)" in caplog.text
            assert "noeviction" in caplog.text
            with pytest.raises(FailedPrecondition, match="noeviction"):  # before: stored, for Redis to drop
                await c.put_blob(b"a tool result")
            policy.config_set("maxmemory-policy", "volatile-lru")  # control: evicts only keys with a TTL
            await _until_health(ctl.address, (SERVING, SERVING))
            assert ctl.store_probe.unfit is None and ctl.ctx.leader
            assert await c.get_blob(await c.put_blob(b"a tool result")) == b"a tool result"
    finally:
        await ctl.stop(0)
