"""One client token cannot take every one of the proxy's RPC slots to the controller (rule: one tenant never
slows another).

The proxy keeps at most `controller_max_rpcs` RPCs open to the controller; the others wait (at most the route
timeout, then 503). A token may hold at most three quarters of them, so a flood from one token leaves room
for the rest.
The controller here is a real grpc.aio server whose Route holds the flooding token's calls for a while. (Tokens
not known yet share one share of their own: tests/controller/proxy/test_proxy_bad_tokens.py.)
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from support.proxy_fleet import BLOCK, MODEL
from support.stub_control import stub_control

from controller.auth import mint_token
from controller.judge_lanes import JudgeLimits
from controller.proxy.control import ControlClient
from controller.router import RouterConfig
from fleet.api.kvfleet.v1 import fleet_pb2, fleet_pb2_grpc
from fleet.api.kvfleet.v1 import route_pb2 as pb
from fleet.api.kvfleet.v1 import route_pb2_grpc as pbg
from fleet.app.testkit.stack import StackConfig, start_stack
from fleet.core.errors import Unavailable
from fleet.sdk import types

HOLD_S = 1.0


class _SlowForOne(pbg.RouteServiceServicer, fleet_pb2_grpc.FleetServiceServicer):
    """Answers Route at once, except for the token "flood", whose calls it holds HOLD_S; WhoAmI: each token is a
    tenant of its own name."""

    def __init__(self) -> None:
        self.routes = 0

    async def Route(self, request: pb.RouteRequest, context: Any) -> pb.RouteResponse:
        self.routes += 1
        if dict(context.invocation_metadata()).get("authorization") == "Bearer flood":
            await asyncio.sleep(HOLD_S)
        return pb.RouteResponse(worker="w0", url="http://127.0.0.1:1", route_id=f"r{self.routes}")

    async def WhoAmI(self, request: fleet_pb2.WhoAmIRequest, context: Any) -> fleet_pb2.WhoAmIResponse:
        token = dict(context.invocation_metadata())["authorization"].removeprefix("Bearer ")
        return fleet_pb2.WhoAmIResponse(tenant=token, role="tenant", name=token)


async def _route_s(control: ControlClient, token: str) -> float:
    t0 = time.perf_counter()
    await control.route([1, 2], "m", lora=None, token=token)
    return time.perf_counter() - t0


async def test_a_flooding_token_leaves_slots_for_the_others() -> None:
    async with stub_control(_SlowForOne()) as control:
        for token in ("flood", "calm"):  # the proxy asks WhoAmI before it routes: each token's tenant is known
            await control.whoami(token)
        flood = [asyncio.ensure_future(_route_s(control, "flood")) for _ in range(16)]
        await asyncio.sleep(0.2)  # the flood's calls hold their slots (and wait for more)
        calm = await _route_s(control, "calm")
        assert calm < HOLD_S / 2, f"another token's route waited {calm:.2f}s behind the flood"
        took = await asyncio.gather(*flood)
        # control: the flood itself was held, 6 calls at a time (three quarters of the 8 slots): 3 rounds of HOLD_S
        assert min(took) >= HOLD_S * 0.9 and max(took) >= HOLD_S * 2.7


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


STARVED = JudgeLimits(tenant_cpu=0.001, burst_s=0.001)  # a tenant's judge lane: almost no CPU


class _Starved:
    """A stack whose judging is starved (each tenant's judge lane has almost no CPU), so a tenant's tool-result
    requests each hold one of the proxy's 8 RPC slots while they wait; `post` times one request."""

    def __init__(self, stack: Any, tokens: dict[str, str]) -> None:
        self.stack, self.tokens, self.lanes = stack, tokens, stack.ctl.ctx.judge_lanes
        self.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    @classmethod
    async def start(cls, tmp_path: Path, tenants: tuple[str, ...],
                    judge: JudgeLimits = STARVED) -> _Starved:
        stack = await start_stack(StackConfig(
            store_url=f"sqlite:///{tmp_path / 'kv.db'}", state_dir=str(tmp_path), workers=1, num_blocks=512,
            block_size=BLOCK, model=MODEL, tenants=tenants, operator="ops", operator_name="", sessions=False,
            metrics=True, router=RouterConfig(reconcile_interval_s=0.5),
            controller={"detector_layers": ("rules",), "judge": judge},
            proxy={"controller_max_rpcs": 8, "route_timeout_s": 1.5, "refresh_s": 0.2}))
        assert stack.proxy is not None
        await stack.client.close()
        return cls(stack, dict(stack.tokens))

    async def post(self, token: str, body: dict[str, Any]) -> tuple[int, float]:
        t0 = time.perf_counter()
        async with self.http.post(self.stack.proxy.url + "/v1/chat/completions", json=body,
                                  headers={"Authorization": f"Bearer {token}"}) as r:
            await r.read()
            return r.status, time.perf_counter() - t0

    def judged(self, tenant: str) -> int:  # the tenant's judge calls at the controller: each holds one proxy slot
        return sum(self.lanes.stats(tenant)[k] for k in ("queued", "inflight"))

    async def held(self, tenant: str, num: int) -> None:
        deadline = time.monotonic() + 10
        while self.judged(tenant) < num:
            assert time.monotonic() < deadline, self.lanes.stats(tenant)
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)  # the rest of the floods' calls take what slots they can

    async def stop(self, flood: list[asyncio.Future[tuple[int, float]]]) -> None:
        for f in flood:
            f.cancel()
        await asyncio.gather(*flood, return_exceptions=True)
        await self.http.close()
        await self.stack.stop()


PLAIN = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hello"}]}


async def test_a_tenants_tokens_share_one_tenants_slots(tmp_path: Path) -> None:
    """A tenant with two tokens floods requests whose judging waits in its lane (its CPU budget spent), each
    holding one of the proxy's 8 RPC slots meanwhile; another tenant's ordinary request is answered at once.
    Before, each token had its own three quarters (6 + 6 of 8): the flood held all 8, and the other tenant's
    Route waited route_timeout_s, then got a 503 (or a slot another call happened to free)."""
    st = await _Starved.start(tmp_path, ("acme", "bravo"))
    acme = [st.tokens["acme"], mint_token(tmp_path / "tokens.json", "acme", "tenant", "acme-2")]
    flood: list[asyncio.Future[tuple[int, float]]] = []
    try:
        for token in [*acme, st.tokens["bravo"]]:
            assert (await st.post(token, PLAIN))[0] == 200  # each token's WhoAmI answered (and cached)
        flood = [asyncio.ensure_future(st.post(acme[i % 2], _tool_chat(i))) for i in range(16)]
        await st.held("acme", 6)  # 6 judge calls held at least
        status, took = await st.post(st.tokens["bravo"], PLAIN)
        assert status == 200 and took < 0.5, f"bravo's request: {status} after {took:.2f}s behind acme's flood"
        assert not any(f.done() for f in flood)  # control: the flood was still held meanwhile
    finally:
        await st.stop(flood)


async def test_two_flooding_tenants_leave_slots_for_a_third(tmp_path: Path) -> None:
    """Tenants acme and bravo each flood requests whose judging waits in their own lane, each holding one of the
    proxy's 8 RPC slots meanwhile; charlie's ordinary request is answered at once. Before, each flood's share was
    three quarters (6) whatever the other held: together they held all 8, and charlie's Route waited behind their
    waiting calls route_timeout_s, then got a 503. Control: acme flooding alone holds its 6 slots."""
    st = await _Starved.start(tmp_path, ("acme", "bravo", "charlie"))
    flood: list[asyncio.Future[tuple[int, float]]] = []
    try:
        for tenant in ("acme", "bravo", "charlie"):
            assert (await st.post(st.tokens[tenant], PLAIN))[0] == 200  # each token's WhoAmI answered (and cached)
        flood = [asyncio.ensure_future(st.post(st.tokens["acme"], _tool_chat(i))) for i in range(12)]
        await st.held("acme", 6)
        assert st.judged("acme") == 6, "control: a tenant alone holds three quarters of the slots"
        flood += [asyncio.ensure_future(st.post(st.tokens["bravo"], _tool_chat(100 + i))) for i in range(12)]
        await st.held("bravo", 1)
        status, took = await st.post(st.tokens["charlie"], PLAIN)
        assert status == 200 and took < 0.5, f"charlie's request: {status} after {took:.2f}s behind two floods"
        assert not any(f.done() for f in flood)  # control: both floods were still held meanwhile
    finally:
        await st.stop(flood)


async def test_a_tenant_past_its_share_takes_an_idle_slot_when_no_one_under_theirs_waits(tmp_path: Path) -> None:
    """bravo, charlie and delta each have one request whose judging waits in their lane, and acme one: four tenants
    in use, a share of 6 // 4 = 1 slot each, 4 of the 8 slots held. acme's ordinary request is answered at once.
    Before, a tenant at its share waited whatever was free: acme's Route waited route_timeout_s beside 4 idle slots,
    then got a 503. Control: a fifth tenant's first request is answered at once too (the reserve is kept)."""
    tenants = ("acme", "bravo", "charlie", "delta", "echo")
    # the first tool result judged overdraws its tenant's budget (refilled in seconds): the next waits in its lane
    st = await _Starved.start(tmp_path, tenants, JudgeLimits(tenant_cpu=0.0001, burst_s=0.0001))
    slow: list[asyncio.Future[tuple[int, float]]] = []
    try:
        for tenant in tenants:
            assert (await st.post(st.tokens[tenant], PLAIN))[0] == 200  # each token's WhoAmI answered (and cached)
        firsts = await asyncio.gather(*(st.post(st.tokens[t], _tool_chat(i)) for i, t in enumerate(tenants[:4])))
        assert [status for status, _ in firsts] == [200] * 4
        slow = [asyncio.ensure_future(st.post(st.tokens[t], _tool_chat(10 + i))) for i, t in enumerate(tenants[:4])]
        for tenant in tenants[:4]:
            await st.held(tenant, 1)
        slots = st.stack.proxy.control._slots
        assert slots.share() == 1 and slots._shares[("tenant", "acme")].held >= 1 and slots.num_held < 6
        status, took = await st.post(st.tokens["acme"], PLAIN)
        assert status == 200 and took < 0.5, f"acme's request: {status} after {took:.2f}s beside 4 idle slots"
        status, took = await st.post(st.tokens["echo"], PLAIN)
        assert status == 200 and took < 0.5, f"control: echo's request: {status} after {took:.2f}s"
        assert not any(f.done() for f in slow)  # control: the four were still held meanwhile
    finally:
        await st.stop(slow)
