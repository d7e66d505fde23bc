"""KeyedSlots with a total: a key's share is split between the keys in use, and a freed slot goes to the waiting
key that holds the fewest (tests/controller/proxy/test_proxy_fair_slots.py has the proxy's case end to end)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from controller.keyed_slots import KeyedSlots
from fleet.core.errors import Unavailable


async def _take(stack: contextlib.AsyncExitStack, slots: KeyedSlots, key: str, n: int) -> None:
    for _ in range(n):
        await stack.enter_async_context(slots.hold(key, 0.05, "call"))


async def test_shares_split_between_the_keys_in_use_and_a_newcomer_gets_a_slot_at_once() -> None:
    slots = KeyedSlots(6, 8)
    async with contextlib.AsyncExitStack() as a:
        await _take(a, slots, "a", 6)  # alone: per_key, the quarter left free
        with pytest.raises(Unavailable, match="this caller already has 6 of them"):
            await _take(a, slots, "a", 1)
        async with contextlib.AsyncExitStack() as b, contextlib.AsyncExitStack() as c:
            await _take(b, slots, "b", 1)  # a key's first slot, past the 6 the keys hold together
            with pytest.raises(Unavailable, match="all 8 were busy"):
                await _take(b, slots, "b", 1)
            await _take(c, slots, "c", 1)  # the last one: a third key is served at once
            assert slots.share() == 2 and slots.num_held == 8
        # b and c gone: a is alone again, over nothing but its own share
        with pytest.raises(Unavailable, match="this caller already has 6 of them"):
            await _take(a, slots, "a", 1)
    assert len(slots) == 0 and slots.num_held == 0 and not slots._waiting


async def test_a_freed_slot_goes_to_the_waiting_key_with_the_fewest() -> None:
    slots = KeyedSlots(2, 2)  # a key alone holds both
    async with contextlib.AsyncExitStack() as a:
        await _take(a, slots, "a", 2)
        order: list[str] = []

        async def wait(key: str) -> None:
            async with slots.hold(key, None, "call"):
                order.append(key)
                await asyncio.sleep(0.01)

        waiters = [asyncio.ensure_future(wait(k)) for k in ("a", "a", "b")]
        await asyncio.sleep(0)
    await asyncio.gather(*waiters)
    assert order[0] == "b"  # b held none; a's own waiters came first
    assert len(slots) == 0 and slots.num_held == 0


async def test_a_waiter_cancelled_as_it_is_granted_gives_the_slot_back() -> None:
    slots = KeyedSlots(1, 1)
    async with contextlib.AsyncExitStack() as a:
        await _take(a, slots, "a", 1)
        waiter = asyncio.ensure_future(_take(contextlib.AsyncExitStack(), slots, "b", 1))
        await asyncio.sleep(0)
    waiter.cancel()  # granted by the release above, not resumed yet
    with contextlib.suppress(asyncio.CancelledError):
        await waiter
    assert slots.num_held == 0 and len(slots) == 0


async def test_a_key_past_its_share_takes_an_idle_slot_no_key_needs_to_reach_its_own() -> None:
    slots = KeyedSlots(6, 8)
    async with contextlib.AsyncExitStack() as a, contextlib.AsyncExitStack() as others:
        for key in ("b", "c", "d"):
            await _take(others, slots, key, 1)
        await _take(a, slots, "a", 1)
        assert slots.share() == 1
        await _take(a, slots, "a", 2)  # past its share of 1: lent, each key holds its share (before: refused)
        assert slots.num_held == 6  # per_key: the keys together take no more, the reserve stays free
        with pytest.raises(Unavailable, match="this caller already has 3 of them"):
            await _take(a, slots, "a", 1)
    async with contextlib.AsyncExitStack() as a, contextlib.AsyncExitStack() as b:
        await _take(b, slots, "b", 1)
        await _take(a, slots, "a", 3)  # a's share of 3
        with pytest.raises(Unavailable, match="this caller already has 3 of them"):
            await _take(a, slots, "a", 1)  # not lent: b's share needs 2 more of the 6
        await _take(b, slots, "b", 2)  # taken at once
    assert len(slots) == 0 and slots.num_held == 0 and not slots._waiting
