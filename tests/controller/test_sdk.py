"""The SDK: typed results, errors as fleet.errors with the server's message, retries on UNAVAILABLE only."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import threading
import time
from pathlib import Path

import pytest
from ctl_helpers import make_tokens, start_controller, store_url

from fleet.errors import InvalidArgument, NotFound, PermissionDenied, Unauthenticated, Unavailable
from fleet.redis_server import free_port
from fleet.sdk import AsyncFleetClient, BlobRef, FleetClient, RetryPolicy


@dataclasses.dataclass(frozen=True)
class CountingPolicy(RetryPolicy):
    """A RetryPolicy that records every backoff it computes (one per retry)."""

    log: list = dataclasses.field(default_factory=list)

    def backoff(self, attempt: int) -> float:
        d = RetryPolicy.backoff(self, attempt)
        self.log.append((attempt, d))
        return d


async def test_typed_results_and_errors(tmp_path: Path) -> None:
    tok = make_tokens(tmp_path)
    ctl = await start_controller(store_url("sqlite", tmp_path), tok)
    try:
        await asyncio.to_thread(_sync_typed, ctl.address, tok)
        async with AsyncFleetClient(ctl.address, token=tok.op) as ac:
            caller = await ac.whoami()
            assert caller.role == "operator" and (await ac.get_blob(await ac.put_blob(b"x" * 10))) == b"x" * 10
            fleet = await ac.fleet()
            assert fleet.leader and fleet.workers == ()
    finally:
        await ctl.stop(0)


def _sync_typed(address: str, tok) -> None:
    """Sync client in a thread (the server shares the test's event loop)."""
    policy = CountingPolicy()
    with FleetClient(address, token=tok.a, retry=policy) as c:
        ref = c.put_blob(b"tool result")
        assert isinstance(ref, BlobRef) and str(ref) == ref.ref and ref.size == 11
        with pytest.raises(dataclasses.FrozenInstanceError):
            ref.size = 3  # type: ignore[misc]
        assert c.get_blob(ref) == c.get_blob(ref.ref) == b"tool result"
        info = c.stat_blob(ref)
        assert (info.ref, info.size) == (ref.ref, 11) and info.created > 0
        assert c.whoami() == type(c.whoami())("acme", "tenant", "acme")
        with pytest.raises(NotFound) as nf:
            c.get_blob("ab" * 32)
        with pytest.raises(PermissionDenied, match="needs the operator role"):
            c.workers()
        with pytest.raises(InvalidArgument, match="token ids"):
            c.route([-1], model="m")
    assert policy.log == []  # none of those errors was retried
    print("NotFound message from the server:", nf.value)
    with FleetClient(address, token="kvf_wrong") as c, pytest.raises(Unauthenticated, match="invalid bearer token"):
        c.whoami()


async def test_retries_until_the_server_comes_up(tmp_path: Path) -> None:
    tok = make_tokens(tmp_path)
    port = free_port()
    policy = CountingPolicy(initial_backoff_s=0.1, deadline_s=30)
    result: dict[str, object] = {}

    def call() -> None:
        with FleetClient(f"127.0.0.1:{port}", token=tok.a, retry=policy) as c:
            result["first_try"] = time.monotonic()
            result["ref"] = c.put_blob(b"late server")

    t = threading.Thread(target=call)
    t.start()
    while not policy.log:  # the first attempt failed with UNAVAILABLE before any server existed
        await asyncio.sleep(0.02)
    ctl = await start_controller(store_url("sqlite", tmp_path), tok, listen=f"127.0.0.1:{port}")
    try:
        await asyncio.to_thread(t.join, 30)
        print("retries before success:", len(policy.log), [round(d, 3) for _, d in policy.log])
        assert isinstance(result.get("ref"), BlobRef) and len(policy.log) >= 1
        assert [a for a, _ in policy.log] == list(range(len(policy.log)))
    finally:
        await ctl.stop(0)


async def test_gives_up_after_the_deadline() -> None:
    port = free_port()
    policy = CountingPolicy(initial_backoff_s=0.05, max_backoff_s=0.2, deadline_s=1.0, max_attempts=100)
    async with AsyncFleetClient(f"127.0.0.1:{port}", token="t", retry=policy) as c:
        with pytest.raises(Unavailable) as ei:
            await c.whoami()
    msg = str(ei.value)
    print(msg)
    m = re.search(r"unavailable after (\d+) attempt\(s\) over (\d+\.\d)s", msg)
    assert m and f"127.0.0.1:{port}" in msg and "kvfleet controller" in msg
    # backoffs 0.05, 0.1, 0.2, 0.2, ... (+-20%) inside a 1 s deadline: a handful of attempts, not a spin
    assert 4 <= int(m.group(1)) <= 12 and len(policy.log) >= int(m.group(1)) - 1
    assert float(m.group(2)) <= 1.5


async def test_retries_while_the_redis_store_is_down(redis_server, redis_url: str, tmp_path: Path) -> None:
    tok = make_tokens(tmp_path)
    ctl = await start_controller(redis_url, tok)
    try:
        policy = CountingPolicy(initial_backoff_s=0.2, deadline_s=60)
        async with AsyncFleetClient(ctl.address, token=tok.a, retry=policy) as c:
            ref = await c.put_blob(b"survives a store outage")
            redis_server.kill()
            task = asyncio.create_task(c.get_blob(ref))
            while not policy.log:
                await asyncio.sleep(0.05)
            redis_server.start()
            got = await asyncio.wait_for(task, 60)
        print("retries during the outage:", len(policy.log))
        assert got == b"survives a store outage" and len(policy.log) >= 1
    finally:
        await ctl.stop(0)

