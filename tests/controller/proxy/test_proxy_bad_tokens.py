"""Made-up bearer tokens cannot flood the controller with WhoAmI calls or take the known tenants' RPC slots.

Anyone who reaches the proxy can send tokens; each one the proxy does not know yet costs a WhoAmI. So a token
the controller refused is answered 401 by the proxy itself for `auth_refused_s`, and all the tokens not known yet
share one share of the RPC slots (three quarters), never more, whatever their number.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from support.proxy_fleet import MODEL, start_fleet
from support.stub_control import Holds, stub_control

from controller.auth import mint_token
from controller.proxy.refused import RefusedTokens
from fleet.api.kvfleet.v1 import fleet_pb2, route_pb2
from fleet.api.kvfleet.v1 import fleet_pb2_grpc as fleet_grpc
from fleet.api.kvfleet.v1 import route_pb2_grpc as route_grpc
from fleet.core.errors import Unauthenticated

PLAIN = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hello"}]}


async def test_a_flood_of_made_up_tokens_asks_the_controller_once_a_token(tmp_path: Path) -> None:
    """50 clients, each retrying its own made-up token 4 times, beside a known tenant's requests. Before, every
    request cost the controller a WhoAmI (200 refusals); now one a token (50) at most, the rest answered 401
    locally (or 429: the clients share one address, which may have 4 tokens in lookup at once)."""
    fleet = await start_fleet(tmp_path, num_workers=1, auth_refused_s=30.0)
    book = fleet.ctl.ctx.auth.book
    assert book is not None
    refusals = 0
    lookup = book.lookup

    def counted(token: str) -> Any:
        nonlocal refusals
        ident = lookup(token)
        refusals += ident is None
        return ident

    book.lookup = counted  # type: ignore[method-assign]
    url = fleet.proxy.url + "/v1/chat/completions"

    async def post(token: str) -> tuple[int, float, bytes]:
        t0 = time.perf_counter()
        async with fleet.http.post(url, json=PLAIN, headers={"Authorization": f"Bearer {token}"}) as r:
            return r.status, time.perf_counter() - t0, await r.read()

    async def bad_client(i: int) -> list[tuple[int, float, bytes]]:
        return [await post(f"kvf_made-up-{i}") for _ in range(4)]

    async def known(n: int) -> list[float]:
        out = []
        for _ in range(n):
            status, took, body = await post(fleet.tokens["a"])
            assert status == 200, body
            out.append(took)
        return out

    try:
        alone = await known(10)  # control: the known tenant without the flood (its WhoAmI answered and cached)
        assert refusals == 0
        flood = asyncio.gather(*(bad_client(i) for i in range(50)))
        beside = await known(10)
        answers = [a for c in await flood for a in c]
        # the controller's words, cached or not; or, past the 4 tokens in lookup at once from this address, a 429
        assert {s for s, _, _ in answers} <= {401, 429} and any(s == 401 for s, _, _ in answers)
        assert all(b"invalid bearer token" in b for s, _, b in answers if s == 401)
        assert all(b"the proxy does not know yet" in b for s, _, b in answers if s == 429)
        print(f"\nknown tenant p50 alone {statistics.median(alone) * 1e3:.1f} ms, beside the flood "
              f"{statistics.median(beside) * 1e3:.1f} ms; controller refusals: {refusals} of {len(answers)} requests")
        assert refusals <= 50, f"{refusals} WhoAmI refusals at the controller for 50 made-up tokens"
        fresh = mint_token(tmp_path / "tokens.json", "acme", "tenant", "acme-new")  # a new token is not a refused one
        status, _, body = await post(fresh)
        assert status == 200, body
    finally:
        await fleet.stop()


class _Fake(fleet_grpc.FleetServiceServicer, route_grpc.RouteServiceServicer):
    """WhoAmI: "calm" and "fresh" are tenant bravo at once; any other token is refused once `release` is set."""

    def __init__(self) -> None:
        self.holds = Holds()

    async def WhoAmI(self, request: fleet_pb2.WhoAmIRequest, context: Any) -> fleet_pb2.WhoAmIResponse:
        token = dict(context.invocation_metadata())["authorization"].removeprefix("Bearer ")
        if token in ("calm", "fresh"):
            return fleet_pb2.WhoAmIResponse(tenant="bravo", role="tenant", name=token)
        await self.holds.hold()
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "invalid bearer token")
        raise AssertionError("unreachable")

    async def Route(self, request: route_pb2.RouteRequest, context: Any) -> route_pb2.RouteResponse:
        return route_pb2.RouteResponse(worker="w0", url="http://127.0.0.1:1", route_id="r1")


async def test_tokens_not_known_yet_share_one_share_of_the_slots() -> None:
    """16 distinct made-up tokens whose WhoAmI the controller holds: together they hold 6 of the 8 slots (before,
    each had a share of its own: they held all 8, and a known tenant's Route waited behind them). A known tenant's
    Route is answered while they are held; a new legitimate token's first WhoAmI gets through behind them."""
    fake = _Fake()
    async with stub_control(fake) as control:
        assert (await control.whoami("calm")).tenant == "bravo"
        flood = [asyncio.ensure_future(control.whoami(f"made-up-{i}")) for i in range(16)]
        deadline = time.monotonic() + 10  # a bound on the loop, not a measurement
        while fake.holds.held < 6 or sum(s.users for s in control._slots._shares.values()) < 16:  # 6 held, 10 waiting
            assert time.monotonic() < deadline, (fake.holds.held, control._slots._shares)
            await asyncio.sleep(0.02)
        first = asyncio.ensure_future(control.whoami("fresh"))  # a legitimate token's first request, behind them
        await control.route([1, 2], "m", lora=None, token="calm")
        assert not any(f.done() for f in flood), "the known tenant's Route waited for the flood's WhoAmIs to end"
        assert fake.holds.held == fake.holds.peak == 6, f"{fake.holds.peak} of the 8 slots held by tokens not known yet"
        fake.holds.release.set()
        assert (await first).tenant == "bravo"
        for f in flood:
            with pytest.raises(Unauthenticated):
                await f


def test_refused_tokens_expire_and_the_least_recently_used_goes_first() -> None:
    now = [0.0]
    refused = RefusedTokens(2, 3.0, clock=lambda: now[0])
    refused.add("a", Unauthenticated("no a"))
    refused.add("b", Unauthenticated("no b"))
    assert str(refused.get("a")) == "no a"  # a is now the most recently used
    refused.add("c", Unauthenticated("no c"))
    assert refused.get("b") is None and refused.get("a") is not None and len(refused) == 2
    now[0] = 3.0
    assert refused.get("a") is None and refused.get("c") is None and len(refused) == 0
    assert RefusedTokens(10, 0.0).get("x") is None
    off = RefusedTokens(10, 0.0)
    off.add("x", Unauthenticated("no"))
    assert off.get("x") is None and len(off) == 0


async def test_a_flood_of_made_up_tokens_from_one_address_leaves_a_new_token_from_another_its_lookup(
        tmp_path: Path) -> None:
    """16 clients at one address send distinct made-up tokens at once, whose WhoAmI the controller does not answer
    until the test lets it (a loaded controller: the hold is put in the proxy's call); a valid token the proxy has not
    seen yet is sent from another address meanwhile. Before, the made-up tokens' WhoAmIs held the 6 slots of the tokens not
    known yet, the rest waiting in line, and the valid token's first request waited behind them until the route
    timeout: a 503. Now the address has 4 lookups at once, the 12 past them get a 429 at once, and the valid
    token's first request is answered while the 4 are held. Control: 10 requests at once with a new token from
    the flooding address share one lookup and are all answered."""
    fleet = await start_fleet(tmp_path, num_workers=1, controller_max_rpcs=8, route_timeout_s=1.5)
    control = fleet.proxy.control
    real, asked, held = control._fleet.WhoAmI, Counter[str](), [0, 0]  # lookups of each token; made-up held, peak
    release = asyncio.Event()  # NOTE: the made-up tokens' WhoAmIs are held until the valid token is answered, so
    # the test orders the two instead of timing the answer (it held them 1 s, and asked for an answer within 0.5 s)

    async def who_am_i(request: Any, *, timeout: float, metadata: Any) -> Any:
        token = dict(metadata)["authorization"].removeprefix("Bearer ")
        asked[token] += 1
        if token.startswith("kvf_made-up"):
            held[0] += 1
            held[1] = max(held)
            try:
                await release.wait()
            finally:
                held[0] -= 1
        return await real(request, timeout=timeout, metadata=metadata)

    control._fleet.WhoAmI = who_am_i  # type: ignore[method-assign]
    url = fleet.proxy.url + "/v1/chat/completions"
    other = aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=("127.0.0.2", 0)))

    async def post(token: str, http: aiohttp.ClientSession = fleet.http) -> tuple[int, float, bytes, str | None]:
        t0 = time.perf_counter()
        async with http.post(url, json=PLAIN, headers={"Authorization": f"Bearer {token}"}) as r:
            return r.status, time.perf_counter() - t0, await r.read(), r.headers.get("Retry-After")

    flood: list[asyncio.Future[tuple[int, float, bytes, str | None]]] = []
    try:
        flood = [asyncio.ensure_future(post(f"kvf_made-up-{i}")) for i in range(16)]
        deadline = time.monotonic() + 10  # a bound on the loop, not a measurement
        while held[0] < 4 or sum(f.done() for f in flood) < 12:  # 4 held, the 12 past them answered at once
            assert time.monotonic() < deadline, (held, sum(f.done() for f in flood))
            await asyncio.sleep(0.02)
        fresh = mint_token(tmp_path / "tokens.json", "acme", "tenant", "acme-new")
        status, _, body, _ = await post(fresh, other)
        assert status == 200, f"a new valid token's first request: {status} {body[:200]!r}"
        assert held == [4, 4], f"{held}: WhoAmIs of made-up tokens from one address held, at most at once"
        release.set()
        refused = [f.result() for f in flood if f.done()]
        assert len(refused) == 12 and {(s, ra) for s, _, _, ra in refused} == {(429, "1")}, refused
        assert all(b"bearer tokens the proxy does not know yet" in b for _, _, b, _ in refused)
        assert {s for s, _, _, _ in await asyncio.gather(*flood)} == {401, 429}
        burst = mint_token(tmp_path / "tokens.json", "acme", "tenant", "acme-burst")  # control: one token, 10 at once
        assert [s for s, _, _, _ in await asyncio.gather(*(post(burst) for _ in range(10)))] == [200] * 10
        assert asked[burst] == 1 and asked[fresh] == 1
    finally:
        release.set()
        for f in flood:
            f.cancel()
        await asyncio.gather(*flood, return_exceptions=True)
        await other.close()
        await fleet.stop()


async def test_known_tokens_whose_answer_aged_out_are_not_held_to_the_address_bound(tmp_path: Path) -> None:
    """One address (a gateway in front of its users) sends requests with 6 valid tokens, each answered before; their
    cached WhoAmI answers age out (auth_cache_s) and the 6 come again at once, the controller holding each WhoAmI
    until every request is in a WhoAmI or answered (a loaded controller; the order is the test's, not a race against
    a timer). Before, each was looked up as a token not known yet: 4 at once for the address, and the other 2
    requests got a 429 (no flood anywhere). Now a token the controller has named a tenant for is looked up outside
    the address's bound (in its tenant's share, as before); each token still one lookup."""
    fleet = await start_fleet(tmp_path, num_workers=1, auth_cache_s=0.5)
    control = fleet.proxy.control
    real, asked, held, release = control._fleet.WhoAmI, Counter[str](), [0], [asyncio.Event()]

    async def who_am_i(request: Any, *, timeout: float, metadata: Any) -> Any:
        token = dict(metadata)["authorization"].removeprefix("Bearer ")
        asked[token] += 1
        held[0] += 1
        try:
            await release[0].wait()
        finally:
            held[0] -= 1
        return await real(request, timeout=timeout, metadata=metadata)

    url = fleet.proxy.url + "/v1/chat/completions"

    async def post(token: str) -> int:
        async with fleet.http.post(url, json=PLAIN, headers={"Authorization": f"Bearer {token}"}) as r:
            await r.read()
            return r.status

    async def at_once(tokens: list[str]) -> list[int]:
        """The tokens' requests, their WhoAmIs held until each request is in one or answered without one."""
        release[0] = asyncio.Event()
        posts = [asyncio.ensure_future(post(t)) for t in tokens]
        deadline = time.monotonic() + 10  # a bound on the loop, not a measurement
        while held[0] + sum(p.done() for p in posts) < len(posts):
            assert time.monotonic() < deadline, (held, [p.done() for p in posts])
            await asyncio.sleep(0.02)
        release[0].set()
        return list(await asyncio.gather(*posts))

    try:
        tokens = [mint_token(tmp_path / "tokens.json", "acme", "tenant", f"acme-user-{i}") for i in range(6)]
        assert [await post(t) for t in tokens] == [200] * 6  # each named a tenant (cached)
        control._fleet.WhoAmI = who_am_i  # type: ignore[method-assign]
        await asyncio.sleep(0.6)  # every answer aged out
        assert await at_once(tokens) == [200] * 6
        assert all(asked[t] == 1 for t in tokens), asked
        # control: the address's bound still holds for tokens never named: 6 made-up ones at once, 2 refused
        made_up = await at_once([f"kvf_made-up-{i}" for i in range(6)])
        assert sorted(made_up) == [401] * 4 + [429] * 2, made_up
    finally:
        await fleet.stop()
