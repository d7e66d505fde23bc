"""One tenant's routes hashed on the event loop cannot make another tenant's route wait for all of them.

A prompt of up to hash_lane.INLINE_HASH_TOKENS is hashed on the event loop. Every route of one tenant that arrived at
once was ready on the loop together and ran its hashing in turn, so another tenant's route, ready after them, waited
for them all: with 64 of one tenant's 8,192-token routes in flight, another's 64-token route waited 50 ms at the
median (230 ms behind 256), against 0.4 ms alone (a probe of the real Router with no worker registered). Now a tenant's such
routes take one turn at a time (HashLane.inline_turn), so the other route waits for one of them at most.
Real Router; the hashing is wrapped only to record whose runs in which order.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

import controller.route_phases as route_phases_mod
from controller.hash_lane import INLINE_TURN_TOKENS
from controller.metrics import Metrics
from controller.router import Router, RouterConfig
from fleet.cas import open_store
from fleet.core.errors import NotFound


@pytest.mark.parametrize("b_tokens", [64, INLINE_TURN_TOKENS])
async def test_another_tenants_route_waits_for_one_of_a_flooding_tenants_hashings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, b_tokens: int
) -> None:
    order: list[str] = []
    real = route_phases_mod.checked_chains

    def recorded(jobs: Any, token_ids: Any, model: str, salt: str | None, lora: str | None) -> Any:
        order.append(salt or "?")
        return real(jobs, token_ids, model, salt, lora)

    monkeypatch.setattr(route_phases_mod, "checked_chains", recorded)
    store = open_store(f"sqlite:///{tmp_path}/kv.db")
    r = Router(store, Metrics(), RouterConfig())

    async def route(tenant: str, n: int) -> None:
        with pytest.raises(NotFound):  # no worker registered: the route ends after its ordering
            await r.route(list(range(n)), "m", cache_salt=tenant, owner=tenant)

    try:
        flood = [asyncio.ensure_future(route("a", 2 * INLINE_TURN_TOKENS)) for _ in range(32)]
        b = asyncio.ensure_future(route("b", b_tokens))  # ready on the loop after all 32 of a's
        await asyncio.gather(*flood, b)
    finally:
        store.close()
    print(f"a's hashings before b's: {order.index('b')} of {order.count('a')}")
    assert order.count("a") == 32 and order.index("b") <= 1  # before: 32, every one of a's first
    assert len(r.hash_lane.inline) == 0  # every turn given back


async def test_a_tenant_alone_takes_its_turns_one_after_another(tmp_path: Path) -> None:
    """Control: the turn orders a tenant's routes, it refuses none and loses none."""
    store = open_store(f"sqlite:///{tmp_path}/kv.db")
    r = Router(store, Metrics(), RouterConfig())
    outcomes = await asyncio.gather(*(r.route(list(range(2 * INLINE_TURN_TOKENS)), "m", cache_salt="a", owner="a")
                                      for _ in range(16)), return_exceptions=True)
    store.close()
    assert [type(o).__name__ for o in outcomes] == ["NotFound"] * 16 and len(r.hash_lane.inline) == 0
