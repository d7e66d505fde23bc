"""TokenLookups: the requests of one token share its lookup, and an address's bound counts lookups until they end,
whether or not their requests are still waiting (end to end: test_proxy_bad_tokens.py)."""

from __future__ import annotations

import asyncio

import pytest

from controller.proxy.errors import ProxyError
from controller.proxy.lookups import TokenLookups
from fleet.core.errors import Unauthenticated
from fleet.sdk import types


async def test_a_lookup_counts_against_its_address_until_it_ends_even_when_its_requests_went_away() -> None:
    lookups, gate, asked = TokenLookups(per_client=2), asyncio.Event(), []

    async def ask(token: str) -> types.Caller:
        asked.append(token)
        await gate.wait()
        if token == "bad":
            raise Unauthenticated("invalid bearer token")
        return types.Caller("acme", "tenant", token)

    first = [asyncio.ensure_future(lookups.look_up(t, "10.0.0.1", lambda t=t: ask(t))) for t in ("a", "bad", "a")]
    await asyncio.sleep(0)
    for f in first:
        f.cancel()  # the clients went away: the lookups run on and still count
    with pytest.raises(ProxyError, match="2 bearer tokens the proxy does not know yet") as refused:
        await lookups.look_up("c", "10.0.0.1", lambda: ask("c"))
    assert refused.value.status == 429
    other = asyncio.ensure_future(lookups.look_up("a", "10.0.0.2", lambda: ask("a")))  # joins a's lookup
    gate.set()
    assert (await other).name == "a" and asked == ["a", "bad"]
    await asyncio.sleep(0)
    assert len(lookups) == 0 and not lookups._by_client  # bad's error was retrieved: no warning at exit
    assert (await lookups.look_up("c", "10.0.0.1", lambda: ask("c"))).name == "c"


async def test_the_addresses_of_one_ipv6_64_share_one_bound() -> None:
    # one client holding a /64 sends each made-up token from another of its addresses
    # NOTE: before, each address had a bound of its own: all 8 were looked up at once
    lookups, gate, asked = TokenLookups(per_client=2), asyncio.Event(), []

    async def ask(token: str) -> types.Caller:
        asked.append(token)
        await gate.wait()
        raise Unauthenticated("invalid bearer token")

    flood = [asyncio.ensure_future(lookups.look_up(f"made-up-{i}", f"2001:db8:0:1::{i + 1:x}", lambda i=i: ask(
        f"made-up-{i}"))) for i in range(8)]
    for _ in range(3):  # each look_up started, and each lookup's ask
        await asyncio.sleep(0)
    refused = [f for f in flood if f.done() and isinstance(f.exception(), ProxyError)]
    assert len(asked) == 2 and len(refused) == 6, asked
    # control: another /64 has its own bound, and so has an IPv4 client (its IPv4-mapped address counted as itself)
    others = [asyncio.ensure_future(lookups.look_up(t, a, lambda t=t: ask(t)))
              for t, a in (("x", "2001:db8:0:2::1"), ("y", "::ffff:10.0.0.1"), ("z", "10.0.0.1"))]
    for _ in range(3):  # each look_up started, and each lookup's ask
        await asyncio.sleep(0)
    assert asked[2:] == ["x", "y", "z"]
    gate.set()
    await asyncio.gather(*flood, *others, return_exceptions=True)
    assert len(lookups) == 0 and not lookups._by_client
