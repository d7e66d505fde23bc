"""Leader election across a Redis failover behind the controller's store address (support.redis_failover: two
real servers, the address moved to the new primary, the old one demoted with the lock's connection still open).

NOTE: the leader's renew met READONLY on the demoted primary and it stepped down; its acquire then asked SET NX
on that same pooled connection every ttl/5 for ever, READONLY swallowed: no controller led again (every replica
NOT_SERVING). Now READONLY resets the lock client's pool and the call is asked once more, through the address.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.controller import make_tokens, start_controller
from support.redis_failover import FailoverPair

from controller.leader import KEY
from fleet.sdk import NO_RETRY, AsyncFleetClient

SERVING = health_pb2.HealthCheckResponse.SERVING
TTL_S = 1.0


async def _serving(address: str) -> bool:
    async with grpc.aio.insecure_channel(address) as ch:
        r = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=3)
        return bool(r.status == SERVING)


async def _until(pred: object, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await pred():  # type: ignore[operator]
            return True
        await asyncio.sleep(0.05)
    return False


async def test_the_leader_leads_and_serves_after_a_redis_failover(tmp_path: Path) -> None:
    with FailoverPair(tmp_path) as pair:
        tok = make_tokens(tmp_path)
        ctl = await start_controller(pair.url, tok, leader_election=True, leader_ttl_s=TTL_S, gc_interval_s=0)
        try:
            async def leading() -> bool:
                return ctl.ctx.leader

            assert await _until(leading, 5.0)
            await asyncio.to_thread(pair.wait_replicated, KEY)
            pair.failover()
            t0 = time.monotonic()

            async def led_through_b() -> bool:  # past a ttl: the renews since the failover met the demoted A
                return (time.monotonic() - t0 > 1.5 * TTL_S and ctl.ctx.leader and await _serving(ctl.address)
                        and pair.rb.get(KEY) == ctl._lock.owner.encode())  # type: ignore[union-attr]

            assert await _until(led_through_b, 5.0)  # before: NOT_SERVING, the lock asked of A for ever
            async with AsyncFleetClient(ctl.address, token=tok.a, retry=NO_RETRY) as c:
                ref = await c.put_blob(b"written by the leader after the failover")
            assert pair.rb.exists(f"kvf:t:acme:b:{ref}") == 1
        finally:
            await ctl.stop(0)
