"""One tenant's flood of long prompts cannot take the controller's shared hashing threads from the others.

A prompt over hash_lane.INLINE_HASH_TOKENS is hashed in the loop's default thread pool, which the fleet metrics
poll and the store GC use too. A tenant's long prompts are hashed at most HASH_THREADS_PER_TENANT at a time;
its others wait their turn, so another tenant's long prompt starts at once. Real Router; the hashing
function is wrapped only to record which tenant's hashing runs when, and to make each take 0.2 s.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import controller.hash_lane as hash_lane_mod
from controller.hash_lane import HASH_THREADS_PER_TENANT, INLINE_HASH_TOKENS
from controller.metrics import Metrics
from controller.router import Router, RouterConfig
from fleet.cas import open_store
from fleet.core.errors import NotFound


async def test_a_tenants_long_prompts_take_at_most_its_share_of_the_hashing_threads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    running: dict[str, int] = {"a": 0, "b": 0}
    most: dict[str, int] = {"a": 0, "b": 0}
    started: list[tuple[str, float]] = []
    lock = threading.Lock()
    real = hash_lane_mod.checked_chains

    def recorded(jobs: Any, token_ids: Any, model: str, salt: str | None, lora: str | None) -> Any:
        tenant = salt or "?"
        with lock:
            running[tenant] += 1
            most[tenant] = max(most[tenant], running[tenant])
            started.append((tenant, time.monotonic()))
        time.sleep(0.2)
        try:
            return real(jobs, token_ids, model, salt, lora)
        finally:
            with lock:
                running[tenant] -= 1

    monkeypatch.setattr(hash_lane_mod, "checked_chains", recorded)
    store = open_store(f"sqlite:///{tmp_path}/kv.db")
    r = Router(store, Metrics(), RouterConfig())
    long_prompt = list(range(INLINE_HASH_TOKENS + 16))

    async def route(tenant: str) -> None:
        with pytest.raises(NotFound):  # no worker registered: the route ends after its hashing
            await r.route(long_prompt, "m", cache_salt=tenant, owner=tenant)

    try:
        flood = [asyncio.ensure_future(route("a")) for _ in range(6)]
        await asyncio.sleep(0.05)
        await route("b")
        t_b = next(t for who, t in started if who == "b")
        await asyncio.gather(*flood)
    finally:
        store.close()
    assert most["a"] == HASH_THREADS_PER_TENANT  # the flood ran 2 at a time (control: it did run concurrently)
    assert sum(1 for who, t in started if who == "a" and t > t_b) >= 2  # b did not queue behind all of a's
    assert len(r.hash_lane.slots) == 0
