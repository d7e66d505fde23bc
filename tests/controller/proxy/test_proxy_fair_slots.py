"""One client token cannot take every one of the proxy's RPC slots to the controller (rule: one tenant never
slows another).

The proxy keeps at most `controller_max_rpcs` RPCs open to the controller; the others wait (at most the route
timeout, then 503). A token may hold at most three quarters of them, so a flood from one token leaves room
for the rest.
The controller here is a real grpc.aio server whose Route holds the flooding token's calls until the test lets
it, or a real stack whose controller holds the flooding tenants' judging so: each test releases them only once the
request it checks was answered, and asserts they were still held then, so the order is the test's, never a race
against a timer. (Tokens not known yet share one share of their own: tests/controller/proxy/test_proxy_bad_tokens.py.)
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from support.proxy_fleet import BLOCK, MODEL
from support.stub_control import Holds, stub_control

from controller.auth import mint_token
from controller.proxy.control import ControlClient
from controller.router import RouterConfig
from fleet.api.kvfleet.v1 import fleet_pb2, fleet_pb2_grpc
from fleet.api.kvfleet.v1 import route_pb2 as pb
from fleet.api.kvfleet.v1 import route_pb2_grpc as pbg
from fleet.app.testkit.stack import StackConfig, start_stack
from fleet.core.errors import Unavailable
from fleet.sdk import types


class _SlowForOne(pbg.RouteServiceServicer, fleet_pb2_grpc.FleetServiceServicer):
    """Answers Route at once, except for the token "flood", whose calls it holds until `release` is set (`held` of
    them at once now, `peak` at most); WhoAmI: each token is a tenant of its own name."""

    def __init__(self) -> None:
        self.routes, self.holds = 0, Holds()

    async def Route(self, request: pb.RouteRequest, context: Any) -> pb.RouteResponse:
        self.routes += 1
        if dict(context.invocation_metadata()).get("authorization") == "Bearer flood":
            await self.holds.hold()
        return pb.RouteResponse(worker="w0", url="http://127.0.0.1:1", route_id=f"r{self.routes}")

    async def WhoAmI(self, request: fleet_pb2.WhoAmIRequest, context: Any) -> fleet_pb2.WhoAmIResponse:
        token = dict(context.invocation_metadata())["authorization"].removeprefix("Bearer ")
        return fleet_pb2.WhoAmIResponse(tenant=token, role="tenant", name=token)


async def _until(ready: Any, what: Any) -> None:
    """Wait for ready() (a bound on the loop, not a measurement: `what` says where it stopped)."""
    deadline = time.monotonic() + 10
    while not ready():
        assert time.monotonic() < deadline, what()
        await asyncio.sleep(0.02)


def _users(control: ControlClient) -> int:  # the calls holding or waiting for one of the proxy's slots
    return sum(share.users for share in control._slots._shares.values())


async def test_a_flooding_token_leaves_slots_for_the_others() -> None:
    """16 Routes of one token, held at the controller: another token's Route is answered while they are held
    (before any per-key bound, the flood held all 8 slots and it waited for one: the timeout, then Unavailable)."""
    stub = _SlowForOne()
    async with stub_control(stub) as control:
        for token in ("flood", "calm"):  # the proxy asks WhoAmI before it routes: each token's tenant is known
            await control.whoami(token)
        flood = [asyncio.ensure_future(control.route([1, 2], "m", lora=None, token="flood")) for _ in range(16)]
        await _until(lambda: stub.holds.held >= 6 and _users(control) == 16, lambda: (stub.holds.held, control._slots))
        await control.route([1, 2], "m", lora=None, token="calm")
        assert stub.holds.held == 6 and not any(f.done() for f in flood), "calm's Route waited for the flood's calls to end"
        stub.holds.release.set()
        await asyncio.gather(*flood)
        # control: the flood itself was held 6 calls at a time (three quarters of the 8 slots), never more
        assert stub.holds.peak == 6 and stub.routes == 17


async def test_a_call_past_its_share_fails_saying_so() -> None:
    control = ControlClient("127.0.0.1:1", timeout_s=0.2, max_rpcs=4, stream=False)  # no RPC is sent
    for token, tenant in (("calm", "bravo"), ("third", "charlie")):  # as a WhoAmI would have named them
        control._callers[token] = (time.monotonic() + 60, types.Caller(tenant, "tenant", token))
    try:
        async with contextlib.AsyncExitStack() as held:
            for i in range(3):  # the tokens not known yet, all together: 3 of the 4 slots
                await held.enter_async_context(control._slot("WhoAmI", f"unknown-{i}"))
            with pytest.raises(Unavailable, match="this group of tokens not known yet already has 3 of them, "
                                                  "and none was free within 0.2s"):
                async with control._slot("WhoAmI", "unknown-3"):
                    pass
            async with control._slot("Route", "calm"):  # the quarter left is taken at once
                with pytest.raises(Unavailable, match="the proxy.s RPCs to the controller: all 4 were busy"):
                    async with control._slot("Route", "third"):
                        pass
        assert len(control._slots) == 0  # no caller left: no share kept
    finally:
        await control.close()


def _tool_chat(i: int) -> dict[str, Any]:
    """A chat whose tool result the controller must judge before the proxy routes it (distinct each time)."""
    call = {"id": "c1", "type": "function", "function": {"name": "search", "arguments": "{}"}}
    return {"model": MODEL, "max_tokens": 2, "messages": [
        {"role": "user", "content": "look it up"}, {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": f"result {i}: " + "plain search text " * 200}]}


class _Held:
    """A stack whose controller holds the judging of tool results (JudgeToolResults, in the tenant's judge lane)
    until the test lets it (a loaded judge: the hold is put in the lanes' call), so a tenant's tool-result requests
    each hold one of the proxy's 8 RPC slots meanwhile; `post` sends one request."""

    def __init__(self, stack: Any, tokens: dict[str, str]) -> None:
        self.stack, self.tokens, self.control = stack, tokens, stack.proxy.control
        self.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        self.held, self.release = Counter[str](), asyncio.Event()
        lanes = stack.ctl.ctx.judge_lanes
        real = lanes.run_many

        async def run_many(tenant: str, fn: Any, args: Any) -> Any:
            self.held[tenant] += 1
            try:
                await self.release.wait()
            finally:
                self.held[tenant] -= 1
            return await real(tenant, fn, args)

        lanes.run_many = run_many

    @classmethod
    async def start(cls, tmp_path: Path, tenants: tuple[str, ...]) -> _Held:
        stack = await start_stack(StackConfig(
            store_url=f"sqlite:///{tmp_path / 'kv.db'}", state_dir=str(tmp_path), workers=1, num_blocks=512,
            block_size=BLOCK, model=MODEL, tenants=tenants, operator="ops", operator_name="", sessions=False,
            metrics=True, router=RouterConfig(reconcile_interval_s=0.5), controller={"detector_layers": ("rules",)},
            proxy={"controller_max_rpcs": 8, "route_timeout_s": 1.5, "refresh_s": 0.2}))
        assert stack.proxy is not None
        await stack.client.close()
        return cls(stack, dict(stack.tokens))

    async def post(self, token: str, body: dict[str, Any]) -> int:
        async with self.http.post(self.stack.proxy.url + "/v1/chat/completions", json=body,
                                  headers={"Authorization": f"Bearer {token}"}) as r:
            await r.read()
            return r.status

    async def sent(self, tenant: str, num_held: int, num: int) -> None:
        """Wait until `num_held` of the tenant's judge calls (or more) are held and `num` requests in all have reached
        the proxy's slots (holding one or waiting for one)."""
        await _until(lambda: self.held[tenant] >= num_held and _users(self.control) == num,
                     lambda: (tenant, self.held, self.control._slots._shares))

    async def stop(self, flood: list[asyncio.Future[int]]) -> None:
        self.release.set()
        for f in flood:
            f.cancel()
        await asyncio.gather(*flood, return_exceptions=True)
        await self.http.close()
        await self.stack.stop()


PLAIN = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hello"}]}


async def test_a_tenants_tokens_share_one_tenants_slots(tmp_path: Path) -> None:
    """A tenant with two tokens floods requests whose judging waits in its lane (its CPU budget spent), each
    holding one of the proxy's 8 RPC slots meanwhile; another tenant's ordinary request is answered while they are
    held. Before, each token had its own three quarters (6 + 6 of 8): the flood held all 8, and the other tenant's
    Route waited route_timeout_s, then got a 503."""
    st = await _Held.start(tmp_path, ("acme", "bravo"))
    acme = [st.tokens["acme"], mint_token(tmp_path / "tokens.json", "acme", "tenant", "acme-2")]
    flood: list[asyncio.Future[int]] = []
    try:
        for token in [*acme, st.tokens["bravo"]]:
            assert await st.post(token, PLAIN) == 200  # each token's WhoAmI answered (and cached)
        flood = [asyncio.ensure_future(st.post(acme[i % 2], _tool_chat(i))) for i in range(16)]
        await st.sent("acme", 6, 16)  # 6 judge calls held, the other 10 waiting for a slot
        assert await st.post(st.tokens["bravo"], PLAIN) == 200, "bravo's request behind acme's flood"
        assert st.held["acme"] == 6 and not any(f.done() for f in flood)  # the flood was still held meanwhile
    finally:
        await st.stop(flood)


async def test_two_flooding_tenants_leave_slots_for_a_third(tmp_path: Path) -> None:
    """Tenants acme and bravo each flood requests whose judging waits in their own lane, each holding one of the
    proxy's 8 RPC slots meanwhile; charlie's ordinary request is answered while they are held. Before, each flood's
    share was three quarters (6) whatever the other held: together they held all 8, and charlie's Route waited
    behind their waiting calls route_timeout_s, then got a 503. Control: acme flooding alone holds its 6 slots."""
    st = await _Held.start(tmp_path, ("acme", "bravo", "charlie"))
    flood: list[asyncio.Future[int]] = []
    try:
        for tenant in ("acme", "bravo", "charlie"):
            assert await st.post(st.tokens[tenant], PLAIN) == 200  # each token's WhoAmI answered (and cached)
        flood = [asyncio.ensure_future(st.post(st.tokens["acme"], _tool_chat(i))) for i in range(12)]
        await st.sent("acme", 6, 12)  # 6 held, the rest waiting
        assert st.held["acme"] == 6, "control: a tenant alone holds three quarters of the slots"
        flood += [asyncio.ensure_future(st.post(st.tokens["bravo"], _tool_chat(100 + i))) for i in range(12)]
        await st.sent("bravo", 1, 24)  # bravo's first slot at once (a key's first), the rest wait
        assert await st.post(st.tokens["charlie"], PLAIN) == 200, "charlie's request behind two floods"
        assert st.held == {"acme": 6, "bravo": 1} and not any(f.done() for f in flood)  # both still held meanwhile
    finally:
        await st.stop(flood)


async def test_a_tenant_past_its_share_takes_an_idle_slot_when_no_one_under_theirs_waits(tmp_path: Path) -> None:
    """bravo, charlie and delta each have one request whose judging waits in their lane, and acme one: four tenants
    in use, a share of 6 // 4 = 1 slot each, 4 of the 8 slots held. acme's ordinary request is answered at once.
    Before, a tenant at its share waited whatever was free: acme's Route waited route_timeout_s beside 4 idle slots,
    then got a 503. Control: a fifth tenant's first request is answered while they are held too (the reserve is
    kept)."""
    tenants = ("acme", "bravo", "charlie", "delta", "echo")
    st = await _Held.start(tmp_path, tenants)
    slow: list[asyncio.Future[int]] = []
    try:
        for tenant in tenants:
            assert await st.post(st.tokens[tenant], PLAIN) == 200  # each token's WhoAmI answered (and cached)
        slow = [asyncio.ensure_future(st.post(st.tokens[t], _tool_chat(10 + i))) for i, t in enumerate(tenants[:4])]
        for tenant in tenants[:4]:
            await st.sent(tenant, 1, 4)
        slots = st.control._slots
        assert slots.share() == 1 and slots._shares[("tenant", "acme")].held == 1 and slots.num_held == 4
        assert await st.post(st.tokens["acme"], PLAIN) == 200, "acme's request beside 4 idle slots"
        assert await st.post(st.tokens["echo"], PLAIN) == 200, "control: echo's request"
        assert sum(st.held.values()) == 4 and not any(f.done() for f in slow)  # the four were still held meanwhile
    finally:
        await st.stop(slow)
